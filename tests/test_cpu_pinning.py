"""``deployment.stages.<stage>.cpus``: a vLLM engine core on chosen CPUs of a CPU node."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omni_actors.engines.vllm_core import keep_off, node_cpus, parse_cpus, pinned

ALLOWED = sorted(os.sched_getaffinity(0))


def test_cpu_lists_parse_as_linux_writes_them():
    assert parse_cpus("") == frozenset()
    assert parse_cpus(str(ALLOWED[0])) == {ALLOWED[0]}
    assert parse_cpus(f"{ALLOWED[0]}-{ALLOWED[-1]}") == set(ALLOWED)
    assert parse_cpus(f"{ALLOWED[-1]},{ALLOWED[0]}") == {ALLOWED[0], ALLOWED[-1]}


@pytest.mark.parametrize("text", ["x", "1-0", "0-", "-1", "0;1"])
def test_a_malformed_cpu_list_is_refused(text):
    with pytest.raises(ValueError, match="not a CPU number or range"):
        parse_cpus(text)


def test_a_cpu_this_node_lacks_is_refused_with_the_ones_it_has():
    missing = max(ALLOWED) + 1
    with pytest.raises(ValueError, match=rf"CPU {missing} is not available here \(this node has "):
        parse_cpus(f"{ALLOWED[0]},{missing}")


def test_a_process_started_while_pinned_runs_on_those_cpus_with_one_thread_each():
    cpu = ALLOWED[-1]
    before = os.sched_getaffinity(0), os.environ.get("OMP_NUM_THREADS")
    probe = "import os; print(sorted(os.sched_getaffinity(0)), os.environ.get('OMP_NUM_THREADS'))"
    with pinned(frozenset({cpu})):
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"[{cpu}]", "1"]
    assert (os.sched_getaffinity(0), os.environ.get("OMP_NUM_THREADS")) == before  # only for the block
    with pinned(frozenset()):  # empty: nothing changes
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.startswith(str(sorted(before[0])))


def test_the_config_names_a_bad_cpu_list_by_its_path(tmp_path):
    import yaml

    from omni_actors.config import ConfigError, load_config

    raw = yaml.safe_load(open("configs/cpu_vllm_chain.yaml"))
    raw["deployment"]["stages"]["thinker"]["cpus"] = "1-x"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"deployment\.stages\.thinker\.cpus: '1-x' is not a CPU number or range"):
        load_config(path)
    raw["deployment"]["stages"]["thinker"]["cpus"] = "3-1"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"deployment\.stages\.thinker\.cpus: '3-1' is not"):
        load_config(path)
    # (a code review: this built a set of 10^11 numbers, gigabytes, before any check)
    raw["deployment"]["stages"]["thinker"]["cpus"] = "0-99999999999"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"cpus: '0-99999999999' names CPU 99999999999, above 8191"):
        load_config(path)
    raw["deployment"]["stages"]["thinker"]["cpus"] = "0-1,3"
    path.write_text(yaml.safe_dump(raw))
    assert load_config(path).deployment.stages["thinker"].cpus == "0-1,3"
    raw["deployment"]["stages"]["thinker"]["cpus"] = 1  # YAML `cpus: 1`: one CPU, not a type error
    path.write_text(yaml.safe_dump(raw))
    assert load_config(path).deployment.stages["thinker"].cpus == "1"
    raw["deployment"]["stages"]["thinker"]["cpus"] = -1
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"deployment\.stages\.thinker\.cpus: -1 is not a CPU number"):
        load_config(path)


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs 2 CPUs")
def test_a_replica_moves_its_own_threads_off_its_engines_cpus():
    engine = ALLOWED[-1]
    probe = ("import os, threading; from omni_actors.engines.vllm_core import keep_off; "
             "t = threading.Thread(target=threading.Event().wait, args=(2,), daemon=True); t.start(); "
             f"keep_off(frozenset({{{engine}}})); "
             "print(*[sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir('/proc/self/task')])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    others = str(sorted(set(ALLOWED) - {engine})).replace(" ", "")
    threads = out.split()  # every thread: the main one, the one already running, any other
    assert len(threads) >= 2 and set(threads) == {others}
    assert engine in node_cpus()


def test_cpus_on_a_backend_that_cannot_pin_says_so_in_the_notes(tmp_path):
    import yaml

    from omni_actors.config import load_config

    raw = yaml.safe_load(open("configs/cpu_omni_demo.yaml"))
    raw["deployment"]["stages"]["thinker"]["cpus"] = "0"
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(raw))
    notes = load_config(path).omni_connectors.notes
    assert "deployment.stages.thinker.cpus: not applied: only the vllm backend pins its engine (backend: synthetic)" \
        in notes
