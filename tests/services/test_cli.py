"""CLI contract: model init, generate JSON lines, demo, and bad input -> exit 2 with one line."""

import json
import subprocess
import sys

import pytest
from hybridcache.services.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_model_init_and_generate(tmp_path, capsys):
    d = tmp_path / "m"
    code, out, _ = run_cli(
        capsys, "model", "init", "--arch", "qwen3_5", "--preset", "tiny", "--out", str(d), "--seed", "3"
    )
    assert code == 0 and json.loads(out)["model_dir"] == str(d)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (d / f).is_file()
    req = {
        "system": "sys ",
        "segments": ["first document text, long enough to be cached " * 2, [5, 6, 7] * 10],
        "suffix": "question?",
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
    }
    (tmp_path / "r.json").write_text(json.dumps([req, req]))
    code, out, _ = run_cli(capsys, "generate", "--model", str(d), "--request", str(tmp_path / "r.json"))
    assert code == 0
    lines = [json.loads(x) for x in out.strip().splitlines()]
    assert len(lines) == 2
    for obj in lines:
        assert set(obj) >= {"text", "output_ids", "prompt_ids", "stats"}
        assert set(obj["stats"]) >= {"prompt_tokens", "reused_tokens", "live_tokens", "segments", "ttft_ms"}
        assert len(obj["output_ids"]) == 4
    assert [s["hit"] for s in lines[0]["stats"]["segments"]] == [False, False]
    assert all(s["hit"] for s in lines[1]["stats"]["segments"])
    assert lines[0]["output_ids"] == lines[1]["output_ids"]
    assert lines[1]["stats"]["reused_tokens"] > lines[0]["stats"]["reused_tokens"]


BAD_REQUESTS = [
    ({"sampling_params": {}}, "no segments and no suffix"),
    ({"segments": ["ok", ""], "suffix": "q"}, "segment 1 is empty"),
    ({"segments": [[1, 2, 99999]], "suffix": "q"}, "outside the vocabulary"),
    ({"segments": ["x" * 5000], "suffix": "q"}, "context limit"),
    ({"suffix": "q", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"suffix": "q", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"suffix": "q", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"suffix": "q", "sampling_params": {"bogus": 1}}, "unknown sampling parameter"),
    ({"segments": "not a list", "suffix": "q"}, "segments must be a list"),
]


@pytest.mark.parametrize("req,needle", BAD_REQUESTS, ids=[n for _, n in BAD_REQUESTS])
def test_bad_request_exits_2_with_one_line(req, needle, qwen35_dir, tmp_path, capsys):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(req))
    code, out, err = run_cli(capsys, "generate", "--model", str(qwen35_dir), "--request", str(f))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_bad_model_dirs_exit_2(qwen35_dir, tmp_path, capsys):
    import shutil

    req = tmp_path / "r.json"
    req.write_text(json.dumps({"suffix": "q"}))
    unknown = tmp_path / "unknown"
    shutil.copytree(qwen35_dir, unknown)
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["model_type"] = "gpt_nonexistent"
    (unknown / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "generate", "--model", str(unknown), "--request", str(req))
    assert code == 2 and "unsupported model_type 'gpt_nonexistent'" in err

    missing = tmp_path / "missing"
    shutil.copytree(qwen35_dir, missing)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, str(missing / "model.safetensors"))
    code, _, err = run_cli(capsys, "generate", "--model", str(missing), "--request", str(req))
    assert code == 2 and "1 missing tensor(s), the first 'model.layers.2.self_attn.k_proj.weight'" in err

    code, _, err = run_cli(capsys, "generate", "--model", str(qwen35_dir), "--request", str(tmp_path / "nope.json"))
    assert code == 2 and "cannot read request file" in err
    (tmp_path / "broken.json").write_text("{not json")
    code, _, err = run_cli(capsys, "generate", "--model", str(qwen35_dir), "--request", str(tmp_path / "broken.json"))
    assert code == 2 and "not valid JSON" in err


def test_console_script_exit_code(tmp_path):
    """The real process: bad arguments and bad requests exit 2 with one stderr line, no traceback."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridcache.services.cli",
            "model",
            "init",
            "--arch",
            "llama",
            "--preset",
            "tiny",
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "unknown arch 'llama'" in r.stderr and "Traceback" not in r.stderr


def test_tensor_shape_mismatch_exits_2(qwen35_dir, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "shape"
    shutil.copytree(qwen35_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(bad / "model.safetensors"))
    (tmp_path / "r.json").write_text(json.dumps({"suffix": "q"}))
    code, _, err = run_cli(capsys, "generate", "--model", str(bad), "--request", str(tmp_path / "r.json"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"tensor {name} has shape" in err and "config expects" in err


def test_bad_sdpa_backends_exit_2(qwen35_dir, tmp_path, capsys):
    req = tmp_path / "r.json"
    req.write_text('{"segments": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], "suffix": [1, 2]}')
    code, out, err = run_cli(capsys, "generate", "--model", str(qwen35_dir), "--request", str(req),
                             "--sdpa-backends", "flash,fastest")
    assert code == 2 and out == ""
    assert "sdpa_backends 'flash,fastest'" in err and "comma list" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(
    not (__import__("hybridcache.services.runtime.modelzoo", fromlist=["x"]).SHIPPED_MODEL / "config.json").is_file(),
    reason="models/default is not shipped in this checkout",
)
def test_demo_answers_the_sample_question_and_reuses_every_document(capsys, monkeypatch):
    """`hybridcache demo` on the shipped QA model: the right answer both times, all documents built
    on the first request and reused (in another order) on the second."""
    from hybridcache.services.cli import sample_rag_request

    monkeypatch.delenv("HYBRIDCACHE_MODEL", raising=False)
    req, _, expected = sample_rag_request()
    n = len(req["segments"])
    code, out, _ = run_cli(capsys, "demo")
    assert code == 0
    answers = [line.split("answer: ", 1)[1] for line in out.splitlines() if "] answer: " in line]
    assert [a.strip(" '\"") for a in answers] == [expected, expected], out
    assert f"segments hit 0/{n}" in out and f"segments hit {n}/{n}" in out, out
