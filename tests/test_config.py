"""config.py is the one place that defines and reads HETSERVE_* variables; logs.py shows our logs in tritonserver's
output. The tree checks parse the real sources (ast), the CLI check runs the real `hetserve config`, the log check
reads the log of the session's live decode server (tests/conftest.py `topology`)."""
from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hetserve import config

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("python_backends", "model_repository") for p in sorted((ROOT / d).rglob("*.py"))]
NAME = re.compile(r"\bHETSERVE_[A-Z0-9_]*[A-Z0-9]\b")

ALLOWED_READERS: list = []  # none: every HETSERVE_* read goes through config.get
READ_METHODS = {"get", "getenv", "pop", "setdefault"}


def _env_reads(path: Path):
    """(line, name) of every HETSERVE_* variable read in `path` other than through config: x.get("HETSERVE_..")
    (os.environ, a child env dict, ...), os.getenv, x["HETSERVE_.."] loads, and calls of module aliases such as
    `e = os.environ.get` (a call of a name that is not a function defined in the file)."""
    tree = ast.parse(path.read_text(), str(path))
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def lit(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
            and NAME.fullmatch(node.value) else None

    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args and lit(n.args[0]):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr in READ_METHODS and not (
                    isinstance(f.value, ast.Name) and f.value.id == "config"):
                yield n.lineno, lit(n.args[0])
            elif isinstance(f, ast.Name) and f.id not in defined:
                yield n.lineno, lit(n.args[0])
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and lit(n.slice):
            if not (isinstance(n.value, ast.Attribute) and n.value.attr == "VARS"):
                yield n.lineno, lit(n.slice)


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _allowed(rel: str) -> bool:
    return any(fnmatch.fnmatch(rel, pat) for pat in ALLOWED_READERS)


def test_variables_are_read_only_through_config():
    reads = {_rel(p): list(_env_reads(p)) for p in SOURCES if p.name != "config.py" or p.parent.name != "hetserve"}
    bad = [f"{rel}:{line}: {name}" for rel, rs in reads.items() if not _allowed(rel) for line, name in rs]
    assert not bad, "read HETSERVE_* through hetserve.config.get (define it in config.py):\n" + "\n".join(bad)
    stale = [pat for pat in ALLOWED_READERS
             if not any(rs for rel, rs in reads.items() if fnmatch.fnmatch(rel, pat))]
    assert not stale, f"no file matching {stale} reads the environment any more: delete the ALLOWED_READERS line"


def test_the_checker_sees_the_ways_code_reads_env(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\ne = os.environ.get\n"
                   "def f(env):\n    return env.get('HETSERVE_A'), os.environ['HETSERVE_B'], e('HETSERVE_C'),"
                   " os.getenv('HETSERVE_D'), config.get('HETSERVE_OK'), g('HETSERVE_OK')\n"
                   "def g(name):\n    return config.get(name)\n")
    assert sorted(n for _, n in _env_reads(src)) == ["HETSERVE_A", "HETSERVE_B", "HETSERVE_C", "HETSERVE_D"]


def test_every_variable_the_code_names_is_defined():
    used = {}
    for p in SOURCES:
        for name in NAME.findall(p.read_text()):
            used.setdefault(name, _rel(p))
    missing = {n: f for n, f in used.items() if n not in config.VARS}
    assert not missing, f"define these in hetserve/config.py (name, type, default, bound, doc): {missing}"
    unused = sorted(set(config.VARS) - set(used) - {"HETSERVE_LOG_LEVEL"})
    assert not unused, f"config.py defines variables nothing uses: {unused}"


def test_definitions_are_complete_and_defaults_within_bounds():
    for v in config.VARS.values():
        assert v.doc and len(v.doc) <= 110 and "\n" not in v.doc, v.name
        assert v.type in (str, int, float, bool), v.name
        if v.default is not None:
            assert isinstance(v.default, v.type), v.name
            assert v.parse(str(v.default)) == v.default, v.name  # the default passes its own bounds


def test_get_types_bounds_and_empty_values():
    env = {"HETSERVE_KV_BUDGET_MB": "1.5", "HETSERVE_MAX_BATCH": "", "HETSERVE_DECODE_URL": "",
           "HETSERVE_SNAPSHOTS": "off"}
    assert config.get("HETSERVE_KV_BUDGET_MB", env) == 1.5
    assert config.get("HETSERVE_MAX_BATCH", env) == 16  # empty number: the default
    assert config.get("HETSERVE_DECODE_URL", env) == ""  # empty string: a value
    assert config.get("HETSERVE_SNAPSHOTS", env) is False
    assert config.get("HETSERVE_KV_REDIS_MB", {}) is None
    for name, raw, match in [("HETSERVE_MAX_BATCH", "x", "HETSERVE_MAX_BATCH='x': not an integer"),
                             ("HETSERVE_KV_HOST_MB", "lots", "expected a number"),
                             ("HETSERVE_MAX_BATCH", "0", ">= 1"),
                             ("HETSERVE_SNAPSHOT_INTERVAL_S", "301", "<= 300"),
                             ("HETSERVE_KV_DTYPE", "bf16", "one of fp32"),
                             ("HETSERVE_SNAPSHOTS", "maybe", "0/1")]:
        with pytest.raises(ValueError, match=match):
            config.get(name, {name: raw})
    with pytest.raises(KeyError):
        config.get("HETSERVE_NOT_A_VARIABLE")


def test_hetserve_config_lists_every_variable_and_hides_secrets():
    env = {**os.environ, "HETSERVE_MAX_BATCH": "8", "HETSERVE_ADMIN_KEY": "s3cret-key"}
    out = subprocess.run([sys.executable, "-m", "hetserve", "config", "--json"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == set(config.VARS)
    assert rows["HETSERVE_MAX_BATCH"]["value"] == "8" and rows["HETSERVE_MAX_BATCH"]["default"] == "16"
    assert rows["HETSERVE_ADMIN_KEY"]["value"] == "(set)" and "s3cret" not in out
    bad = subprocess.run([sys.executable, "-m", "hetserve", "config"], env={**env, "HETSERVE_MAX_BATCH": "x"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "INVALID" in bad.stdout


def test_setup_tags_lines_and_follows_the_level(monkeypatch, capfd):
    import logging

    from hetserve import logs

    root = logging.getLogger("hetserve")
    saved = root.handlers[:], root.level, root.propagate
    try:
        monkeypatch.setenv("HETSERVE_LOG_LEVEL", "WARNING")
        logs.setup("unit")
        logging.getLogger("hetserve.x").info("hidden")
        logging.getLogger("hetserve.x").warning("shown")
        monkeypatch.setenv("HETSERVE_LOG_LEVEL", "info")
        logs.setup("unit2")
        logging.getLogger("hetserve.x").info("now shown")
        err = capfd.readouterr().err
        assert "hidden" not in err and "WARNING [unit] hetserve.x: shown" in err
        assert "INFO [unit2] hetserve.x: now shown" in err
        assert len([h for h in root.handlers if h.get_name() == logs._HANDLER]) == 1
    finally:
        root.handlers[:], root.level, root.propagate = saved


def test_model_log_lines_reach_tritonserver_log(topology):
    """Live: every Python model of the decode and prefill servers announced itself through logs.setup, and the
    line sits in that tritonserver's own output (its log file), tagged with the model name."""
    expect = {"decode": ["decode", "kv_ingest"],
              "prefill": ["llm", "prefill", "preprocess", "postprocess", "aggregated"]}
    for role, models in expect.items():
        text = Path(topology.servers[role].spec.log_file).read_text(errors="replace")
        for m in models:
            line = re.search(rf"INFO \[{m}\] hetserve\.logs: {m}: pid \d+, hetserve from ([^\s,]+)", text)
            assert line, f"no log line of model {m} in the {role} server log:\n{text[-3000:]}"
            assert line.group(1) == str(ROOT / "python_backends" / "hetserve")  # this checkout's package
