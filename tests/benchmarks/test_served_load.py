"""benchmarks/served_load.py end to end on CPU at a tiny size: it starts `hybridcache up` itself,
runs both scenarios, and its figures are computed from requests that really completed."""

import importlib.util
import json
import sys
from pathlib import Path


def _served_load():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "served_load.py"
    spec = importlib.util.spec_from_file_location("served_load", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["served_load"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_streams_and_rag_sweep_through_a_stack_it_starts(qwen35_dir, tmp_path, capsys):
    sl = _served_load()
    out = tmp_path / "r.json"
    assert sl.main(["--model", str(qwen35_dir), "--scenario", "streams,rag", "--streams", "1,3",
                    "--requests-per-stream", "2", "--max-tokens", "6", "--prompt-tokens", "20",
                    "--modes", "pic,prefix", "--rates", "2,50", "--rag-requests", "4", "--warmup-requests", "1",
                    "--docs", "6", "--doc-tokens", "40", "--docs-per-request", "2,4", "--question-tokens", "8",
                    "--rag-max-tokens", "3", "--slo-ttft-s", "30", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == res
    streams = res["results"]["streams"]
    assert streams["1"]["completed"] == 2 and streams["3"]["completed"] == 6
    assert streams["3"]["output_tokens"] == 6 * 6 and streams["3"]["itl_ms"]["p50"] > 0
    f = res["figures"]
    assert f["requests_per_s_3_streams_vs_1"] == round(
        streams["3"]["requests_per_s"] / streams["1"]["requests_per_s"], 3)
    assert {"decode_tokens_per_s_3_streams_vs_1", "itl_p50_3_streams_vs_1"} <= set(f)
    for mode in ("pic", "prefix"):
        sweep = res["results"]["rag"][mode]["sweep"]
        assert [s["completed"] for s in sweep.values()] == [4, 4]
        # a 30 s SLO holds at both rates here: the QPS at the SLO is the highest rate swept
        assert res["results"]["rag"][mode]["qps_at_slo"] == 50.0 == f[f"served_qps_at_slo_{mode}"]
    assert f["served_qps_at_slo_pic_vs_prefix"] == 1.0
    assert res["machine"] == "cpu" and res["commit"] and res["command"].startswith("python benchmarks/served_load.py")
    # runs of one scenario or mode each merge into one result, the figures computed over them all
    other = dict(res, results={"rag": {"full": dict(res["results"]["rag"]["pic"], qps_at_slo=25.0)}},
                 command="python benchmarks/served_load.py --modes full")
    (tmp_path / "full.json").write_text(json.dumps(other))
    assert sl.main(["--combine", str(out), str(tmp_path / "full.json"), "--out", str(tmp_path / "all.json")]) == 0
    merged = json.loads((tmp_path / "all.json").read_text())
    assert set(merged["results"]["rag"]) == {"pic", "prefix", "full"} and merged["results"]["streams"] == streams
    assert merged["figures"]["served_qps_at_slo_pic_vs_full"] == 2.0
    assert merged["figures"]["served_qps_at_slo_pic_vs_prefix"] == 1.0
    assert merged["commands"] == [res["command"], other["command"]]


def test_init_model_writes_a_directory_the_loader_reads(tmp_path):
    import torch
    from hybridcache.services.runtime.loader import load_model

    sl = _served_load()
    sl.init_model("qwen3_5_text:tiny", tmp_path / "m", "cpu", "bfloat16")
    model = load_model(tmp_path / "m", "cpu", torch.bfloat16)
    assert model.cfg.model_type == "qwen3_5_text"
    assert next(model.parameters()).dtype == torch.bfloat16
    assert {p.name for p in (tmp_path / "m").iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
