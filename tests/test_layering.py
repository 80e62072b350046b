"""The package's layering, read from the source (every import statement, at module level or inside a function):
no import circles, lower layers never import upper ones, and nothing below the Triton adapters imports Triton's
Python-backend binding. A static check: it fails on the commit that adds the import, not when a server loads."""
import ast
import collections
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "python_backends" / "hetserve"

# lowest first; a module may import its own layer and the ones before it. Everything not listed (triton/,
# openai_api/, cli, server, cluster, doctor, planner/, ...) is the top: the adapters and tools.
LAYERS = [
    ("base", ["errors", "config", "faults", "retry", "bounded", "logs", "admin_key", "grpc_streams"]),
    ("model", ["sampling", "model", "tokenizer", "schema", "structured"]),
    ("engines and KV", ["engines", "kv"]),
    ("serving logic", ["scheduler", "stages", "reliability", "client", "admin_channel", "diagnostics"]),
]
TRITON_BINDING = "triton_python_backend_utils"


def _modules():
    out = {}
    for p in PKG.rglob("*.py"):
        parts = ("hetserve",) + p.relative_to(PKG).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(mods):
    """module -> {(imported module, line)} for every import of a hetserve module or the Triton binding."""
    graph = collections.defaultdict(set)
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    b = ".".join(base + ([node.module] if node.module else []))
                else:
                    b = node.module or ""
                targets = [f"{b}.{a.name}" if f"{b}.{a.name}" in mods else b for a in node.names]
            else:
                continue
            for t in targets:
                if t == TRITON_BINDING or (t in mods and t != m and not m.startswith(t + ".")):
                    graph[m].add((t, node.lineno))
    return graph


def _layer(m: str) -> int:
    rel = m.split(".", 1)[1] if "." in m else ""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(rel == p or rel.startswith(p + ".") for p in prefixes):
            return i
    return len(LAYERS)


def test_no_import_circles():
    mods = _modules()
    graph = {m: {t for t, _ in ts if t in mods} for m, ts in _imports(mods).items()}
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(mods):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_lower_layers_never_import_upper_ones_or_triton():
    mods = _modules()
    bad = []
    for m, targets in sorted(_imports(mods).items()):
        for t, line in sorted(targets):
            if t == TRITON_BINDING:
                if _layer(m) < len(LAYERS):
                    bad.append(f"{mods[m].relative_to(PKG.parent)}:{line} imports the Triton binding")
            elif _layer(t) > _layer(m):
                bad.append(f"{mods[m].relative_to(PKG.parent)}:{line} ({LAYERS[_layer(m)][0]}) imports {t}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_what_it_should():
    """The graph is not empty and the layers name real modules (a renamed package would pass silently)."""
    mods = _modules()
    graph = _imports(mods)
    assert any(t == "hetserve.errors" for ts in graph.values() for t, _ in ts)
    for _, prefixes in LAYERS:
        for p in prefixes:
            assert any(m == f"hetserve.{p}" or m.startswith(f"hetserve.{p}.") for m in mods), p
    assert any(t == TRITON_BINDING for ts in graph.values() for t, _ in ts)  # the adapters do import it


def test_no_silent_broad_except():
    """A handler of Exception / BaseException / everything logs, re-raises, or hands the error on (reply.error,
    a callback, a result), or says on its `except` line why swallowing is right; it never just passes."""
    silent = []
    for p in sorted(PKG.rglob("*.py")):
        src = p.read_text()
        lines = src.splitlines()
        for node in ast.walk(ast.parse(src, str(p))):
            if not isinstance(node, ast.ExceptHandler):
                continue
            names = ([node.type] if not isinstance(node.type, ast.Tuple) else node.type.elts) if node.type else []
            broad = node.type is None or any(isinstance(n, ast.Name) and n.id in ("Exception", "BaseException")
                                             for n in names)
            if not broad or "#" in lines[node.lineno - 1]:
                continue
            uses_error = node.name is not None and any(isinstance(n, ast.Name) and n.id == node.name
                                                       for b in node.body for n in ast.walk(b))
            acts = any(isinstance(n, (ast.Raise, ast.Call)) for b in node.body for n in ast.walk(b))
            if not (uses_error or acts):
                silent.append(f"{p.relative_to(PKG.parent)}:{node.lineno}")
    assert not silent, "broad except that neither logs, re-raises, uses the error nor says why:\n" + "\n".join(silent)


def _metric_names_in_code():
    """hetserve_* names the code counts: `*_METRIC = "..."` constants and the first argument of registry calls."""
    names = {}
    for p in PKG.rglob("*.py"):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                    isinstance(t, ast.Name) and t.id.endswith("_METRIC") for t in node.targets):
                names[node.value.value] = p.name
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("inc", "set", "observe", "declare") and node.args
                  and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                  and node.args[0].value.startswith("hetserve_")):
                names[node.args[0].value] = p.name
    return names


def test_every_metric_the_code_counts_is_declared():
    """A name missing from triton/metrics.py _SPECS is never exported (the registry cannot make its family): the
    llm's hetserve_request_errors_total was counted and never reached /metrics (found 2026-12-07)."""
    tree = ast.parse((PKG / "triton" / "metrics.py").read_text())
    specs = next(set(ast.literal_eval(k) for k in n.value.keys) for n in ast.walk(tree)
                 if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_SPECS" for t in n.targets))
    used = _metric_names_in_code()
    assert {"hetserve_request_errors_total", "hetserve_migrations_total"} <= set(used)  # the scan sees them
    missing = {n: f for n, f in used.items() if n not in specs}
    assert not missing, f"metrics counted but not declared in _SPECS: {missing}"
