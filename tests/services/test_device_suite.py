"""scripts/device_suite.sh refuses bad usage with exit 2 and a message before touching anything."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, tmp_path):
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_suite.sh"), *args],
        cwd=tmp_path,  # no .whl/ here: nothing is installed
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")},
        timeout=60,
    )


def test_usage_and_unknown_stage_exit_2(tmp_path):
    r = _run(tmp_path=tmp_path)
    assert r.returncode == 2 and "usage:" in r.stderr
    r = _run("abc123", "bench", "nope", tmp_path=tmp_path)
    assert r.returncode == 2 and "unknown stage nope" in r.stderr
    assert not (tmp_path / "out").exists()  # refused before any set-up or stage ran


def test_triton_cache_restored_and_saved(tmp_path):
    """A carried .triton-cache/triton_cache.tgz is unpacked into TRITON_CACHE_DIR before the stages,
    and the cache (with what the stages added) comes back as $OUT/triton_cache.tgz."""
    import tarfile

    src = tmp_path / "src"
    src.mkdir()
    (src / "kernel.cubin").write_bytes(b"\x00compiled")
    (tmp_path / ".triton-cache").mkdir()
    with tarfile.open(tmp_path / ".triton-cache" / "triton_cache.tgz", "w:gz") as tf:
        tf.add(src / "kernel.cubin", arcname="ab/kernel.cubin")
    cache = tmp_path / "tc"
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_suite.sh"), "abc123", "bench"],
        cwd=tmp_path,  # no benchmarks/ here: the stage fails at once
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "TRITON_CACHE_DIR": str(cache)},
        timeout=60,
    )
    assert "bench rc=" in r.stdout and "Triton cache restored" in r.stdout, r.stdout + r.stderr
    assert (cache / "ab" / "kernel.cubin").read_bytes() == b"\x00compiled"
    with tarfile.open(tmp_path / "out" / "triton_cache.tgz") as tf:
        assert "./ab/kernel.cubin" in tf.getnames()


def test_train_stage_continues_from_a_carried_checkpoint(tmp_path):
    """The train stage passes --init-from .qa-ckpt when a carried checkpoint is there, else none."""
    r = _run("abc123", "train", tmp_path=tmp_path)  # no benchmarks/ here: the script fails at once
    assert "train rc=" in r.stdout and "(init: none)" in r.stdout, r.stdout + r.stderr
    (tmp_path / ".qa-ckpt").mkdir()
    (tmp_path / ".qa-ckpt" / "model.safetensors").write_bytes(b"")
    r = _run("abc123", "train", tmp_path=tmp_path)
    assert "(init: --init-from .qa-ckpt --warmup 20)" in r.stdout, r.stdout + r.stderr


def test_large_triton_cache_comes_back_in_parts_and_is_restored_from_them(tmp_path):
    """A cache over the 16 MiB a returned file may hold is saved as 15 MiB parts; carried parts
    are put back together and unpacked before the stages."""
    import os

    cache = tmp_path / "tc"
    (cache / "kda").mkdir(parents=True)
    blob = os.urandom(20 << 20)  # incompressible: the archive stays over 16 MiB
    (cache / "kda" / "autotune.bin").write_bytes(blob)
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "TRITON_CACHE_DIR": str(cache)}
    run = dict(cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh"), "abc123", "bench"], **run)
    parts = sorted((tmp_path / "out").glob("triton_cache.tgz.??"))
    assert [p.name for p in parts] == ["triton_cache.tgz.aa", "triton_cache.tgz.ab"], r.stdout + r.stderr
    assert all(p.stat().st_size <= 15 << 20 for p in parts)
    assert not (tmp_path / "out" / "triton_cache.tgz").exists()
    # a later call carries the parts in .triton-cache/ and starts from an empty cache folder
    (tmp_path / ".triton-cache").mkdir()
    for p in parts:
        (tmp_path / ".triton-cache" / p.name).write_bytes(p.read_bytes())
    env.update(TRITON_CACHE_DIR=str(tmp_path / "tc2"), OUT=str(tmp_path / "out2"), TRITON_CACHE_SAVE="0")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh"), "abc123", "bench"], **run)
    assert "restored from 2 parts" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "tc2" / "kda" / "autotune.bin").read_bytes() == blob
    assert not list((tmp_path / "out2").glob("triton_cache*"))  # TRITON_CACHE_SAVE=0


def test_served_gpu_stage_runs_the_benchmark_with_its_phases(tmp_path):
    """The served-gpu stage passes SERVED_GPU_PHASES and SERVED_GPU_MERGE to benchmarks/served_gpu.py."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "served_gpu.py").write_text(
        "import sys\nprint('served_gpu: args', sys.argv[1:])\nprint('served_gpu: inproc done in 1.0 s')\n")
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_suite.sh"), "abc123", "served-gpu"], cwd=tmp_path, capture_output=True,
        text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "SERVED_GPU_PHASES": "inproc,pic",
             "SERVED_GPU_MERGE": "prev.json", "TRITON_CACHE_SAVE": "0"})
    assert "served-gpu rc=0" in r.stdout and "inproc done" in r.stdout, r.stdout + r.stderr
    log = (tmp_path / "out" / "served_gpu.log").read_text()
    assert "'--phases', 'inproc,pic', '--merge', 'prev.json', '--out'" in log


def test_multiturn_stage_writes_the_model_first_then_runs(tmp_path):
    """The multiturn stage writes the 9B model in a process of its own unless $SERVED_MODEL holds
    one; a failed write skips the stage, a written model goes to benchmarks/multiturn.py."""
    r = _run("abc123", "multiturn", tmp_path=tmp_path)  # no hybridcache here: the write fails at once
    assert "multiturn: writing the model failed" in r.stderr and "multiturn rc=" not in r.stdout, r.stdout + r.stderr
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_suite.sh"), "abc123", "multiturn"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "SERVED_MODEL": str(model)},
    )
    assert "writing the model failed" not in r.stderr and "multiturn rc=" in r.stdout, r.stdout + r.stderr


def test_itl_sweep_runs_each_budget_and_parts_and_refuses_a_bad_entry(tmp_path):
    """itl-sweep runs the itl phase once per BUDGET:PARTS of ITL_SWEEP, a result file each; an entry
    of another form is refused with exit 2 before anything runs."""
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "ITL_SWEEP": "256:4 128:16", "TRITON_CACHE_SAVE": "0"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh"), "abc123", "itl-sweep"], cwd=tmp_path,
                       capture_output=True, text=True, env=env, timeout=60)  # no benchmarks/ here: each run fails
    assert "itl-sweep budget 256 parts 4 rc=" in r.stdout and "itl-sweep budget 128 parts 16 rc=" in r.stdout, r.stdout
    assert (tmp_path / "out" / "served_long_prompt_itl_b128_p16.log").exists()
    # the model is written once before the runs (here it fails: no torch on this PATH's python3)
    assert r.stderr.count("itl-sweep: writing the model failed") == 1, r.stderr
    r = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh"), "abc123", "itl-sweep"], cwd=tmp_path,
                       capture_output=True, text=True, env={**env, "ITL_SWEEP": "256x4", "OUT": str(tmp_path / "o2")},
                       timeout=60)
    assert r.returncode == 2 and "BUDGET:PARTS" in r.stderr and not (tmp_path / "o2").exists()
