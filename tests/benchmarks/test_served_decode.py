"""benchmarks/served_decode.py: the floor's arithmetic, and the whole script on CPU at a tiny size
(it starts `hybridcache up` itself; its figures come from batches that really decoded)."""

import importlib.util
import json
import sys
from pathlib import Path


def _served_decode():
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("served_decode", bench / "served_decode.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["served_decode"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_floor_counts_weights_states_and_kv():
    sd = _served_decode()
    shape = {"weights_read": 16e9, "embedding_row": 8192, "linear_state_per_request": 50e6, "kv_per_token": 32768}
    f = sd.step_floor(shape, 32, 191.0, 3e12)
    moved = 16e9 + 32 * 8192 + 2 * 32 * 50e6 + 32 * 192 * 32768
    assert f["bytes_per_step"] == int(moved)
    assert abs(f["tokens_per_s"] - 32 / (moved / 3e12)) < 0.01


def test_the_9b_shape_reads_what_its_config_says(tmp_path):
    """model_bytes of the 9B shape from its config alone (the meta device: nothing allocated)."""
    from hybridcache.services.runtime.modelzoo import hf_config

    sd = _served_decode()
    (tmp_path / "config.json").write_text(json.dumps(hf_config("qwen3_5_text", "qwen3.5-9b")))
    b = sd.model_bytes(tmp_path, "bfloat16")
    assert b["linear_state_per_request"] == 24 * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2)
    assert b["kv_per_token"] == 8 * 2 * 4 * 256 * 2
    assert 15e9 < b["weights_read"] < 20e9 and b["embedding_row"] == 4096 * 2


def test_served_decode_on_cpu(qwen35_dir, tmp_path, capsys):
    sd = _served_decode()
    out = tmp_path / "r.json"
    assert sd.main(["--model", str(qwen35_dir), "--device", "cpu", "--dtype", "float32", "--streams", "3,1",
                    "--sampled-streams", "3", "--repeats", "1", "--max-tokens", "40", "--prompt-tokens", "12",
                    "--copy-bandwidth", "1e10", "--up-args", "--scatter-workers 0", "--client-streams-per-process", "2",
                    "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    captured = capsys.readouterr()
    assert json.loads(captured.out) == res
    # a sampled batch runs right after the greedy one of its size
    order = [line.split(":")[1].strip() for line in captured.err.splitlines() if line.startswith("served_decode: ")
             and line.split(":")[1].strip().split(" ")[0] in ("greedy", "sampled")]
    assert order == ["greedy 1", "greedy 3", "sampled 3"], order
    g, s = res["results"]["greedy"], res["results"]["sampled"]
    assert g["1"]["completed"] == 1 and g["3"]["completed"] == 3 == s["3"]["completed"]
    # 3 streams from 2 client processes (their token times on one clock), 1 from this one
    assert g["3"]["client_processes"] == 2 and g["1"]["client_processes"] == 1
    for r in (g["1"], g["3"]):
        assert set(r["cpu_s"]) == {"router", "combine", "client"} and r["cpu_s"]["combine"] > 0
        assert r["server_ttft_ms"]["engine_ttft_ms"]["p50"] > 0 and "p50" in r["server_ttft_ms"]["queue_ms"]
        assert r["server_ttft_ms"]["ttft_ms"]["p90"] <= r["ttft_ms"]["p90"] + 1
    f = res["figures"]
    assert f["served_decode_fraction_of_floor_3_streams"] == round(
        g["3"]["decode_tokens_per_s"] / g["3"]["floor"]["tokens_per_s"], 3) > 0
    assert f["served_sampled_vs_greedy_tokens_per_s_3_streams"] > 0
    assert res["combine_health"]["warmup"] is None or "decode_graphs" in res["combine_health"]["warmup"]
    assert res["gpu"] == "none (CPU)" and res["commit"] and res["date"] and res["copy_bandwidth_tb_per_s"] == 0.01
