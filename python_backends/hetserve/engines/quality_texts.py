"""Built-in texts for the quality gate (engines/quality.py) and for calibrating quantized graphs.

Written for this project (no download). Two disjoint sets, so reported figures are measured on text nothing was
tuned on:
  TUNE_TEXTS  held-in: activation calibration of the QDQ graphs and choosing between quantization options.
  EVAL_TEXTS  held-out: the figures `hetserve build` writes into the manifest and the tests check.
Mixed registers (prose, dialogue, instructions, code, lists, numbers) because quantization error depends on the
token distribution. Each text is long enough for 128 tokens with the SmolLM2 tokenizer.
"""

TEXTS_VERSION = "qt1"

TUNE_TEXTS = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his father had "
    "done before him. There were one hundred and twelve of them, worn smooth in the middle by two centuries of "
    "boots. At the top he trimmed the wick, polished the great lens with a soft cloth, and checked the clockwork "
    "that turned the light. Ships far out on the grey water depended on that slow, steady sweep. On stormy nights "
    "he stayed awake until dawn, listening to the wind hammer the glass and watching for the signal rockets that "
    "meant a crew was in trouble. In forty years he had seen only three wrecks, and he remembered every name.",

    "To make a simple loaf of bread, combine five hundred grams of strong white flour with ten grams of salt and "
    "seven grams of dried yeast in a large bowl. Add three hundred and fifty millilitres of lukewarm water and mix "
    "until a rough dough forms. Turn it out onto a lightly floured surface and knead for about ten minutes, until "
    "it feels smooth and elastic. Place the dough back in the bowl, cover it with a damp towel, and leave it "
    "somewhere warm for an hour or until it has doubled in size. Knock it back, shape it into a loaf, and let it "
    "rise again for thirty minutes before baking at two hundred and twenty degrees for thirty-five minutes.",

    "User: Can you explain why the sky looks blue during the day but red at sunset?\nAssistant: Sunlight contains "
    "every colour, and as it passes through the atmosphere it scatters off molecules of nitrogen and oxygen. Short "
    "wavelengths, like blue and violet, scatter much more strongly than long ones, so blue light reaches your eyes "
    "from every direction of the sky. At sunset the light travels through far more air before it reaches you. Most "
    "of the blue has been scattered away long before it arrives, leaving the oranges and reds.\nUser: Then why "
    "isn't the sky violet?\nAssistant: Partly because the sun emits less violet, and partly because our eyes are "
    "more sensitive to blue.",

    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    out = []\n    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
    "    return out\n\n\ndef merge_sort(xs):\n    if len(xs) <= 1:\n        return list(xs)\n    mid = len(xs) // 2\n"
    "    return merge_sorted(merge_sort(xs[:mid]), merge_sort(xs[mid:]))\n\n\nif __name__ == \"__main__\":\n"
    "    print(merge_sort([5, 3, 9, 1, 4, 8, 2, 7]))\n",

    "The French Revolution began in 1789 and transformed the political landscape of Europe. Financial crisis, "
    "poor harvests and resentment of aristocratic privilege combined to bring the old regime to its knees. The "
    "Estates-General was summoned for the first time in more than a century, and the representatives of the Third "
    "Estate declared themselves a National Assembly. In July a crowd stormed the Bastille, a fortress and prison "
    "that had come to symbolise royal tyranny. Over the following years the monarchy was abolished, the king was "
    "executed, and a period known as the Terror saw thousands sent to the guillotine before Napoleon seized power.",

    "Photosynthesis is the process by which green plants, algae and some bacteria convert light energy into "
    "chemical energy. It takes place mainly in the chloroplasts of leaf cells, where the pigment chlorophyll "
    "absorbs red and blue light. In the light-dependent reactions, water molecules are split, releasing oxygen as "
    "a by-product and producing the energy carriers ATP and NADPH. In the Calvin cycle, which does not need light "
    "directly, these carriers are used to fix carbon dioxide from the air into three-carbon sugars. Those sugars "
    "are then built into glucose, starch and cellulose, which feed the plant and, ultimately, almost every animal.",

    "Dear Ms. Okafor,\n\nThank you for your letter of the twelfth regarding the delayed shipment of your order. I "
    "am sorry for the inconvenience this has caused. Our warehouse was closed for three days last week because of "
    "flooding, and we are still working through the backlog. Your parcel left our depot this morning and should "
    "reach you by Thursday. As a gesture of goodwill we have refunded the delivery charge, and you will see the "
    "credit on your account within five working days. If anything arrives damaged, please reply to this message "
    "with a photograph and we will send a replacement at once.\n\nYours sincerely,\nDaniel Brooks\nCustomer Care",

    "Step 1: Turn off the power at the main switch before you touch any wiring.\nStep 2: Remove the old light "
    "fitting by unscrewing the cover plate and gently pulling it away from the ceiling.\nStep 3: Take a photo of "
    "how the wires are connected, so you can refer to it later.\nStep 4: Loosen the terminal screws and disconnect "
    "the live, neutral and earth wires.\nStep 5: Connect the new fitting in the same way, making sure each wire "
    "is firmly held and no bare copper is showing.\nStep 6: Fix the new fitting to the ceiling, replace the cover, "
    "restore the power and test the switch.",

    "In mathematics, a prime number is a natural number greater than one that has no positive divisors other than "
    "one and itself. The first few primes are 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29. Euclid proved more than two "
    "thousand years ago that there are infinitely many of them: if you multiply any finite list of primes together "
    "and add one, the result is not divisible by any prime on the list. The fundamental theorem of arithmetic says "
    "that every integer greater than one can be written as a product of primes in exactly one way, apart from the "
    "order of the factors. Primes are the building blocks of modern cryptography.",

    "The market opened quietly on Monday, with most traders waiting for the central bank's statement on interest "
    "rates. Shares in technology companies rose slightly in early trading, while energy stocks fell as the price "
    "of crude oil slipped below seventy dollars a barrel. By midday the main index was up a quarter of a percent. "
    "When the statement arrived in the afternoon, it said that rates would remain unchanged for now but hinted at "
    "a cut later in the year if inflation continued to ease. Bond yields dropped sharply, the currency weakened "
    "against the dollar, and the index closed almost one percent higher, its best day in a month.",
)

EVAL_TEXTS = (
    "Maria had never seen snow before she moved north for university. On the first cold morning in December she "
    "woke to a strange silence and a pale light coming through the curtains. When she opened them, the whole "
    "street had disappeared under a thick white blanket. Cars were soft shapes, the hedges wore heavy caps, and a "
    "single line of footprints led from the house opposite to the bus stop. She pulled on two jumpers and her "
    "thinnest shoes, ran outside, and stood in the middle of the road with her face turned up, letting the flakes "
    "land on her cheeks. Her neighbour, shovelling his drive, laughed and told her she would need proper boots.",

    "User: What is the difference between a virus and a bacterium?\nAssistant: Bacteria are single-celled living "
    "organisms. They have their own machinery for making proteins and energy, and most of them can reproduce on "
    "their own by dividing in two. Many are harmless or even helpful, like the bacteria in your gut. Viruses are "
    "much smaller and are not really alive in the usual sense: they are packets of genetic material wrapped in a "
    "protein coat, and they can only copy themselves by hijacking the cells of a host.\nUser: Is that why "
    "antibiotics don't work on a cold?\nAssistant: Exactly. Antibiotics target structures that bacteria have and "
    "viruses lack, so they do nothing against the viruses that cause colds.",

    "class Stack:\n    \"\"\"A last-in, first-out container backed by a Python list.\"\"\"\n\n    def __init__(self):\n"
    "        self._items = []\n\n    def push(self, item):\n        self._items.append(item)\n\n    def pop(self):\n"
    "        if not self._items:\n            raise IndexError(\"pop from empty stack\")\n"
    "        return self._items.pop()\n"
    "\n    def peek(self):\n        return self._items[-1] if self._items else None\n\n    def __len__(self):\n"
    "        return len(self._items)\n\n\ndef balanced(text):\n    pairs = {')': '(', ']': '[', '}': '{'}\n"
    "    s = Stack()\n    for ch in text:\n        if ch in '([{':\n            s.push(ch)\n        elif ch in pairs:\n"
    "            if not len(s) or s.pop() != pairs[ch]:\n                return False\n    return not len(s)\n",

    "The human heart is a muscular organ about the size of a closed fist. It sits slightly to the left of the "
    "centre of the chest and beats around one hundred thousand times a day. It has four chambers: two upper atria "
    "that receive blood and two lower ventricles that pump it out. The right side collects blood that has given "
    "up its oxygen to the body and sends it to the lungs, where it picks up fresh oxygen and releases carbon "
    "dioxide. The left side receives this oxygen-rich blood and pushes it through the aorta to every organ. Valves "
    "between the chambers keep the blood flowing in one direction, and their closing makes the familiar sound.",

    "To change a flat tyre, first park on firm, level ground away from traffic and switch on your hazard lights. "
    "Apply the handbrake and place a wedge behind the wheel diagonally opposite the flat one. Loosen the wheel nuts "
    "by half a turn while the tyre is still on the ground. Position the jack under the reinforced point of the "
    "frame, as shown in the handbook, and raise the car until the tyre is a few centimetres clear of the road. "
    "Remove the nuts and the wheel, fit the spare, and tighten the nuts by hand in a star pattern. Lower the car, "
    "tighten the nuts fully with the wrench, and check the pressure of the spare as soon as you can.",

    "The Silk Road was not a single road but a network of trade routes that linked China with Central Asia, the "
    "Middle East and the Mediterranean for more than fifteen hundred years. Merchants rarely travelled its whole "
    "length. Instead, goods passed from hand to hand through oasis towns such as Samarkand, Kashgar and Merv, "
    "gaining value at every stage. Silk, porcelain and paper moved west, while horses, glassware, wool and silver "
    "moved east. Just as important were the ideas that travelled with the caravans: Buddhism spread from India "
    "into China, and techniques for making paper and gunpowder eventually reached Europe along the same paths.",

    "Meeting notes, Tuesday 14 March\nAttendees: Priya, Tom, Chen, Sofia\n1. Budget: Chen reported that spending "
    "on the pilot is eight percent under plan. The savings will cover the extra survey in April.\n2. Schedule: Tom "
    "said the supplier can deliver the sensors on the 28th, two weeks later than promised. Sofia will check "
    "whether the installation team can move its visit.\n3. Recruitment: two candidates for the analyst role will "
    "be interviewed next week. Priya will send the questions by Friday.\n4. Any other business: the office will "
    "be closed on the 3rd for maintenance.\nActions: Sofia to confirm the installation date; Priya to book rooms.",

    "An ecosystem is a community of living things together with the physical environment they share. In a pond, "
    "for example, sunlight feeds the algae and water plants, which are eaten by snails, insect larvae and small "
    "fish. Those in turn are eaten by larger fish, frogs and herons. When plants and animals die, bacteria and "
    "fungi break them down and return their nutrients to the water and mud, where they are taken up again by new "
    "growth. Removing a single species can have surprising effects. If the herons disappear, the number of fish "
    "may rise, the insect larvae may decline, and the algae they used to graze may spread across the surface.",

    "The committee has considered the planning application for the new sports centre on Mill Lane. Residents "
    "raised concerns about traffic, noise in the evenings and the loss of trees along the northern boundary. The "
    "developer has agreed to reduce the car park from two hundred spaces to one hundred and forty, to add a "
    "cycle shelter, and to close the outdoor pitches at nine o'clock. Twelve mature oaks will be kept and a new "
    "hedge planted along the footpath. With these changes, and subject to conditions on construction hours and "
    "drainage, the committee voted by seven votes to two to approve the application. Work is expected to begin "
    "in the autumn.",

    "Temperature readings for the first week: Monday 12.4 degrees, Tuesday 13.1, Wednesday 11.8, Thursday 9.6, "
    "Friday 10.2, Saturday 14.7 and Sunday 15.3. The average was 12.4 degrees, almost exactly the long-term mean "
    "for the season. Rainfall totalled 23 millimetres, most of it on Thursday, when a band of heavy showers crossed "
    "the region from the west between two and six in the afternoon. Wind speeds peaked at 48 kilometres per hour "
    "on Thursday evening. The forecast for next week is drier, with high pressure building from the south and "
    "daytime temperatures rising to between 16 and 18 degrees by Friday, although nights will stay cool.",
)
