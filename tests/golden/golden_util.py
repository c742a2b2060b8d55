"""Shared helpers for the tests/golden/make_*.py generators (not run directly).

- REPO: the repository root (paths given to the generators are relative to it).
- sha256_file(): hex SHA-256 of a file.
- reference_llama(): a llama-cpp-python Llama with the reference settings used by
  every golden (flash attention disabled, F16 KV cache, logits for every position).
- write_json(): deterministic JSON writer that keeps lists of numbers on one line,
  so fixture files stay small and diffable.
- golden_arguments(), golden_header(), write_golden(): the command line, the
  versioned header and the writing every golden file shares;
  write_tokenizer_golden() the layout of the tokenizer goldens.
"""
import argparse
import hashlib
import json
import os
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
REFERENCE = "llama-cpp-python 0.3.36"
FORMAT_VERSION = 1

# Reference settings shared by all generators that run a model.
REFERENCE_SETTINGS = {
    "n_ctx": 1024,
    "n_batch": 1024,
    "n_ubatch": 1024,
    "n_threads": 2,
    "n_threads_batch": 2,
    "logits_all": True,
    "flash_attn": False,
    "seed": 0,
    "n_gpu_layers": 0,
}


def repo_path(p):
    """Resolve a command-line path relative to the repository root."""
    return p if os.path.isabs(p) else os.path.join(REPO, p)


def golden_arguments(description, default_model, default_out):
    """An ArgumentParser with --model and --out (both relative to the repository
    root unless absolute); a generator adds its own options."""
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model,
                    help="GGUF model (relative to the repository root unless absolute)")
    ap.add_argument("--out", default=default_out,
                    help="output JSON (relative to the repository root unless absolute)")
    return ap


def golden_header(generator, model_path):
    """The versioned header a golden file starts with: its format, what made it,
    the reference and its version, and the model (name and SHA-256)."""
    import llama_cpp

    return {
        "format_version": FORMAT_VERSION,
        "generator": generator,
        "reference": REFERENCE,
        "reference_version": llama_cpp.__version__,
        "model": os.path.basename(model_path),
        "model_sha256": sha256_file(model_path),
    }


def check_unique_names(cases):
    """Asserts that no two (name, ...) cases share a name."""
    names = set()
    for name, *_ in cases:
        assert name not in names, name
        names.add(name)


def write_golden(out, doc, summary=""):
    """Writes doc to `out` (a --out argument) and says so on stderr, with `summary`."""
    write_json(repo_path(out), doc)
    print(f"wrote {out}{summary}", file=sys.stderr)


def write_tokenizer_golden(out, generator, model_path, llm, calls, cases):
    """Writes a tokenizer golden: the header, `calls` (how the reference was
    called), the vocabulary's size and the cases, each with its "ids"."""
    doc = {
        **golden_header(generator, model_path),
        **calls,
        "n_vocab": int(llm.n_vocab()),
        "cases": cases,
    }
    write_golden(out, doc, f": {len(cases)} cases, {sum(len(c['ids']) for c in cases)} tokens")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def reference_llama(model_path, **overrides):
    """Load model_path with the reference settings and verify them.

    Returns (llm, settings) where settings is a dict describing what was really
    used (read back from the llama.cpp context parameters).
    """
    import llama_cpp
    from llama_cpp import Llama

    kw = dict(REFERENCE_SETTINGS)
    kw.update(overrides)
    llm = Llama(model_path=model_path, verbose=False, **kw)
    cp = llm.context_params
    # Make sure flash attention is really off and the KV cache is F16.
    assert cp.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED, cp.flash_attn_type
    assert cp.type_k == llama_cpp.GGML_TYPE_F16, cp.type_k
    assert cp.type_v == llama_cpp.GGML_TYPE_F16, cp.type_v
    assert llm.n_ctx() == kw["n_ctx"], llm.n_ctx()
    settings = {
        "n_ctx": int(llm.n_ctx()),
        "n_batch": int(cp.n_batch),
        "n_ubatch": int(cp.n_ubatch),
        "n_threads": int(cp.n_threads),
        "n_threads_batch": int(cp.n_threads_batch),
        "logits_all": True,
        "flash_attn_type": "disabled",
        "type_k": "f16",
        "type_v": "f16",
        "seed": kw["seed"],
        "n_gpu_layers": kw["n_gpu_layers"],
        "device": "cpu",
    }
    return llm, settings


def eog_ids(llm):
    """All token ids llama.cpp treats as end-of-generation for this model."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    return [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def _dump(obj, indent, level):
    pad = " " * (indent * (level + 1))
    end = " " * (indent * level)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad}{json.dumps(str(k), ensure_ascii=False)}: {_dump(v, indent, level + 1)}"
                 for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(obj, (list, tuple)):
        if all(not isinstance(x, (dict, list, tuple)) for x in obj):
            return "[" + ", ".join(json.dumps(x, ensure_ascii=False) for x in obj) + "]"
        if not obj:
            return "[]"
        items = [pad + _dump(v, indent, level + 1) for v in obj]
        return "[\n" + ",\n".join(items) + "\n" + end + "]"
    return json.dumps(obj, ensure_ascii=False)


def write_json(path, obj, indent=1):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(_dump(obj, indent, 0))
        f.write("\n")


def round5(values):
    """Round floats to 5 decimals for JSON (as Python floats, -0.0 normalised)."""
    return [float(round(float(v), 5)) + 0.0 for v in values]
