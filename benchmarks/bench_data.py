"""Data at the scale of a real run: memory per worker, prepare throughput, time per step, time to the first step.

The corpora are built from the King James Bible (the embedded one): its 31 102 verses, shuffled anew on every
pass and repeated, one verse per line, in text files of at most 128 MB (``corpus``); never committed — build them
in a scratch folder of your own (``DIR`` below). Each measurement is its own sub-command, so each can run alone on an
otherwise idle machine; each writes its part of ``results/data.json``, and ``report`` writes ``results/data.md``
from it.

1. ``corpus --bytes N --out DIR``: write the corpus.
2. ``prepare --dataset DIR --out PREP``: ``quietsync prepare`` with the default tokenizer (byte-level BPE, 4096
   entries, trained on every m-th training document, ~50 M characters) and every core; records the wall time of
   the command, the tokens written, and the tokens/s of the encoding phase (reading the text, splitting it,
   encoding on 2 threads, writing the shards: everything after the tokenizer is trained) and of the whole command.
3. ``memory --text DIR --prepared PREP --label L``: one worker's data, in a fresh process each: resident memory
   (``/proc/self/status`` VmRSS, and its anonymous and file-backed parts RssAnon / RssFile; VmHWM for the peak)
   after importing everything and before the data, then after the worker's data set-up and ``--batches``
   micro-batches (8 × 128 tokens, rank 0 of 2) — **mapped** (``open_job_data``: the prepared shards memory-mapped)
   and **today** (what every worker did before: ``load_corpus`` holds every document, ``encode_split`` the token
   stream as int64; its tokenizer and token caches are pre-filled from the prepared folder, so no time goes to
   training or encoding, only to what a worker did at every start).
4. ``steps --prepared PREP``: ``quietsync train`` (2 workers, a core each, ``--model default``, zero1) for
   ``--steps`` steps with the shards mapped and with every worker holding them in memory as int64
   (``QUIETSYNC_DATA_IN_MEMORY=1``), alternating, ``--repeats`` times; seconds per step after 5 warm-up steps,
   from the step records.
5. ``first-step --prepared PREP [PREP ...]``: seconds from starting ``quietsync train --dataset PREP`` (2 workers,
   ``--model default``) to rank 0's first step record, alternating over the folders, ``--repeats`` times.

    python benchmarks/bench_data.py corpus --bytes 10e6 --out data/bible-10mb
    python benchmarks/bench_data.py corpus --bytes 1.1e9 --out data/bible-1gb
    python benchmarks/bench_data.py prepare --dataset data/bible-1gb ...
    python benchmarks/bench_data.py report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import RESULTS, run_train, write_markdown  # noqa: E402

JSON = RESULTS / "data.json"
FILE_BYTES = 128 * 1024 * 1024
SEQ, MBS = 128, 8


def _results() -> dict[str, Any]:
    return json.loads(JSON.read_text()) if JSON.exists() else {}


def _save(key: str, value: Any) -> None:
    data = _results()
    data[key] = {**value, "command": "python benchmarks/bench_data.py " + " ".join(sys.argv[1:])}
    RESULTS.mkdir(parents=True, exist_ok=True)
    JSON.write_text(json.dumps(data, indent=1, sort_keys=True))
    print(json.dumps({key: value}, indent=1))


# ------------------------------------------------------------------------------------------------------ corpus


def make_corpus(total: int, out: Path, seed: int = 0) -> dict[str, Any]:
    """The Bible's verses, shuffled on every pass and repeated, one per line, in files of at most 128 MB."""
    import numpy as np

    from quietsync.data.corpus import kjv_path

    verses = []
    with open(kjv_path(), encoding="utf-8") as f:
        for raw in f:
            if raw.strip():
                row = json.loads(raw)
                verses.append(f"{row['book']} {row['chapter']}:{row['verse']} {row['text']}\n".encode())
    out.mkdir(parents=True, exist_ok=False)
    rng = np.random.default_rng(seed)
    written, part, f = 0, 0, None
    while written < total:
        for i in rng.permutation(len(verses)):
            if f is None or f.tell() >= FILE_BYTES:
                if f is not None:
                    f.close()
                f = open(out / f"part-{part:04d}.txt", "wb")
                part += 1
            f.write(verses[i])
            written += len(verses[i])
            if written >= total:
                break
    f.close()
    return {"bytes": written, "files": part, "verses": len(verses)}


# ----------------------------------------------------------------------------------------------------- prepare


def bench_prepare(dataset: str, out: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "quietsync", "prepare", "--dataset", dataset, "--out", out,
                           "--no-progress"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    index = json.loads((Path(out) / "index.json").read_text())
    tokens = index["splits"]["train"]["tokens"] + index["splits"]["eval"]["tokens"]
    info = index["prepare"]
    size = sum(p.stat().st_size for p in Path(dataset).rglob("*.txt"))
    return {"dataset": dataset, "input_bytes": size, "tokens": tokens, "documents":
            index["splits"]["train"]["documents"] + index["splits"]["eval"]["documents"],
            "wall_s": round(wall, 2), "tokenizer_s": info["tokenizer_seconds"], "encode_s": info["encode_seconds"],
            "encode_tokens_per_s": round(tokens / info["encode_seconds"]),
            "command_tokens_per_s": round(tokens / wall), "threads": info["workers"], "cores": os.cpu_count(),
            "tokenizer": index["tokenizer"]["about"], "stdout": proc.stdout.strip().splitlines()[-1]}


# ------------------------------------------------------------------------------------------------------ memory


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(line.split()[1]) * 1024
    return out


def memory_worker(mode: str, text: str, prepared: str, cache: str, batches: int) -> dict[str, Any]:
    """One worker's data in this process: resident memory before and after (see the module doc)."""
    import torch  # noqa: F401  (the libraries a worker has loaded before its data)
    import transformers  # noqa: F401

    from quietsync.data.corpus import load_corpus
    from quietsync.data.sequences import ShardedSequences, encode_split, eval_batches
    from quietsync.data.tokenizer import job_tokenizer
    from quietsync.train.config import TrainConfig
    from quietsync.train.job_data import open_job_data

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    before = _status()
    t0 = time.perf_counter()
    if mode == "mapped":
        data = open_job_data(TrainConfig(dataset=prepared, model="tiny"))
        train, held = data.train, data.eval
    else:
        corpus = load_corpus(text, 0.02)
        tok, eos = job_tokenizer(None, corpus, 4096, cache)
        train = encode_split(tok, corpus.documents, eos, cache)
        held = encode_split(tok, corpus.eval_documents, eos, cache)
    stream = ShardedSequences(train, SEQ, MBS, 0, 2, seed=0)
    evals = eval_batches(held, SEQ, MBS, 48)
    next(stream)
    setup = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(batches - 1):
        next(stream)
    per_batch = (time.perf_counter() - t1) / max(1, batches - 1)
    after = _status()
    del evals
    return {"mode": mode, "setup_s": round(setup, 3), "batch_ms": round(per_batch * 1e3, 4),
            "tokens": int(train.numel()), "batches": batches,
            **{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()},
            "data_rss": after["VmRSS"] - before["VmRSS"], "data_anon": after["RssAnon"] - before["RssAnon"],
            "data_file": after["RssFile"] - before["RssFile"], "data_peak": after["VmHWM"] - before["VmRSS"]}


def prefill_today(text: str, prepared: str, cache: str) -> None:
    """Put the prepared folder's tokenizer and token streams where today's worker looks for them."""
    import numpy as np

    from quietsync.data.corpus import load_corpus
    from quietsync.data.sequences import token_cache_path
    from quietsync.data.shards import open_prepared
    from quietsync.data.tokenizer import eos_id, tokenizer_path

    data = open_prepared(prepared)
    corpus = load_corpus(text, 0.02)
    tok = data.tokenizer()
    path = tokenizer_path(corpus, 4096, cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    eos = eos_id(tok)
    for docs, split in ((corpus.documents, data.train), (corpus.eval_documents, data.eval)):
        target = token_cache_path(tok, docs, eos, cache)
        if not target.exists():
            with open(target, "wb") as f:
                np.save(f, split.read(0, split.numel()))
    (Path(cache) / "prefilled").write_text("")


def bench_memory(text: str, prepared: str, label: str, batches: int) -> dict[str, Any]:
    cache = str(Path(prepared).with_name(Path(prepared).name + "-today-cache"))
    if not (Path(cache) / "prefilled").exists():  # not measured: run it first under a shared lock (see main)
        prefill = [sys.executable, __file__, "_prefill", "--text", text, "--prepared", prepared, "--cache", cache]
        subprocess.run(prefill, check=True)
    out = {}
    for mode in ("mapped", "today"):
        cmd = [sys.executable, __file__, "_memory", "--mode", mode, "--text", text, "--prepared", prepared,
               "--cache", cache, "--batches", str(batches)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"label": label, "text": text, "prepared": prepared, **out}


# ------------------------------------------------------------------------------------------------------- steps


def _train_flags(prepared: str, steps: int) -> list[str]:
    return ["--dataset", prepared, "--model", "default", "--nproc", "2", "--max-steps", str(steps),
            "--eval-every", "0", "--eval-windows", "4", "--micro-batch-size", str(MBS), "--seq-len", str(SEQ)]


def _step_times(summary: dict[str, Any], skip: int = 5) -> list[float]:
    times = []
    for records in summary["records"]:
        steps = [r for r in records if "event" not in r]
        times.append([b["time_s"] - a["time_s"] for a, b in zip(steps, steps[1:])][skip:])
    return [statistics.mean(t) for t in zip(*times)]  # per step, averaged over the workers


def bench_steps(prepared: str, steps: int, repeats: int, work: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"mapped": [], "in_memory": []}
    for r in range(repeats):
        for mode in (("mapped", "in_memory") if r % 2 == 0 else ("in_memory", "mapped")):
            os.environ.pop("QUIETSYNC_DATA_IN_MEMORY", None)
            if mode == "in_memory":
                os.environ["QUIETSYNC_DATA_IN_MEMORY"] = "1"
            summary = run_train(work / f"{mode}-{r}", *_train_flags(prepared, steps), "--overwrite")
            times = _step_times(summary)
            runs[mode].append({"mean_s": statistics.mean(times), "median_s": statistics.median(times),
                               "steps": len(times), "process_s": summary["process_s"]})
    os.environ.pop("QUIETSYNC_DATA_IN_MEMORY", None)
    mean = {m: statistics.mean(x["mean_s"] for x in v) for m, v in runs.items()}
    median = {m: statistics.mean(x["median_s"] for x in v) for m, v in runs.items()}
    return {"prepared": prepared, "steps": steps, "repeats": repeats, "runs": runs,
            "mapped_over_in_memory_mean": mean["mapped"] / mean["in_memory"],
            "mapped_over_in_memory_median": median["mapped"] / median["in_memory"]}


# -------------------------------------------------------------------------------------------------- first step


def first_step_s(prepared: str, out: Path) -> float:
    """Seconds from starting ``quietsync train --dataset PREPARED`` to rank 0's first step record."""
    cmd = [sys.executable, "-m", "quietsync", "train", *_train_flags(prepared, 3), "--out", str(out),
           "--overwrite", "--no-progress", "--no-plot", "--no-export"]
    metrics = out / "metrics-rank0.jsonl"
    if metrics.exists():
        metrics.unlink()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None and first is None:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                if line.strip() and "event" not in json.loads(line):
                    first = time.perf_counter() - t0
                    break
        time.sleep(0.005)
    proc.wait()
    if proc.returncode != 0 or first is None:
        raise RuntimeError(proc.stderr.read()[-3000:])
    return first


def bench_first_step(prepared: list[str], repeats: int, work: Path) -> dict[str, Any]:
    got: dict[str, list[float]] = {p: [] for p in prepared}
    for _ in range(repeats):
        for p in prepared:
            got[p].append(round(first_step_s(p, work / "first-step"), 3))
    tokens = {p: json.loads((Path(p) / "index.json").read_text())["splits"]["train"]["tokens"] for p in prepared}
    return {p: {"seconds": v, "median_s": statistics.median(v), "train_tokens": tokens[p]} for p, v in got.items()}


# ------------------------------------------------------------------------------------------------------ report


def _command(entry: dict[str, Any]) -> str:
    return f" (`{entry['command']}`)" if "command" in entry else ""


def report() -> None:
    """``results/data.md``: every measurement in ``data.json``, with the command that made it."""
    data = _results()
    mb = 1024 * 1024
    rows, notes = [], [""]
    for key in sorted(k for k in data if k.startswith("memory-")):
        m = data[key]
        for mode in ("mapped", "today"):
            r = m[mode]
            rows.append([m["label"], mode, f"{r['tokens']:,}", f"{r['data_rss'] / mb:.1f}",
                         f"{r['data_anon'] / mb:.1f}", f"{r['data_file'] / mb:.1f}", f"{r['data_peak'] / mb:.1f}",
                         r["setup_s"], r["batch_ms"]])
        notes.append(f"- {m['label']}: {m['text']} prepared into {m['prepared']}{_command(m)}")
    notes += ["", "Rank 0 of 2, 8 x 128-token micro-batches; *mapped*: the prepared shards memory-mapped "
              "(`open_job_data`); *today*: what every worker did before the shards (every document in memory, "
              "the token stream as int64). Data RSS, anon, file: VmRSS, RssAnon, RssFile after the set-up and the "
              "micro-batches minus before; peak: VmHWM minus VmRSS before.", ""]
    notes += ["## `quietsync prepare` throughput (default tokenizer)", ""]
    for key in sorted(k for k in data if k.startswith("prepare-")):
        p = data[key]
        notes += [f"- {p['dataset']} ({p['input_bytes'] / 1e6:,.0f} MB of text, {p['tokens']:,} tokens, "
                  f"{p['documents']:,} documents): {p['wall_s']} s for the command, of which {p['tokenizer_s']} s "
                  f"training the tokenizer and {p['encode_s']} s encoding: **{p['encode_tokens_per_s'] / 1e6:.2f} M "
                  f"tokens/s encoding**, **{p['command_tokens_per_s'] / 1e6:.2f} M tokens/s for the whole command** "
                  f"({p['threads']} threads on {p['cores']} cores; {p['tokenizer']}){_command(p)}."]
    notes.append("")
    for key in sorted(k for k in data if k.startswith("steps-")):
        s = data[key]
        means = {m: [round(x["mean_s"] * 1e3, 1) for x in v] for m, v in s["runs"].items()}
        ratio = s["mapped_over_in_memory_mean"]
        notes += ["## Time per step: mapped vs in memory", "",
                  f"- {s['prepared']}: mapped / in memory = **{ratio:.3f}** (means; medians "
                  f"{s['mapped_over_in_memory_median']:.3f}); ms per step mapped {means['mapped']}, in memory "
                  f"{means['in_memory']} ({s['repeats']} runs each, alternating, {s['steps']} steps, the first 5 "
                  f"left out; 2 workers, default model, zero1){_command(s)}.", ""]
    for key in sorted(k for k in data if k.startswith("first-step")):
        notes += ["## From `quietsync train --dataset PREPARED` to the first step", ""]
        for p, v in data[key].items():
            if isinstance(v, dict):
                notes.append(f"- {p} ({v['train_tokens']:,} training tokens): median **{v['median_s']:.2f} s** "
                             f"({v['seconds']}).")
        notes += [f"\n2 workers, default model; the time to rank 0's first step record{_command(data[key])}.", ""]
    path = write_markdown("data", "Data at the scale of a real run\n\n## Resident memory per worker for the data",
                          ["corpus", "path", "training tokens", "data RSS MiB", "anon MiB", "file MiB", "peak MiB",
                           "set-up s", "ms / micro-batch"], rows,
                          "\n".join(notes) + "\nMethod: benchmarks/bench_data.py (its docstring).")
    print(path.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--bytes", type=float, required=True)
    c.add_argument("--out", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--dataset", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--text", required=True)
    m.add_argument("--prepared", required=True)
    m.add_argument("--label", required=True)
    m.add_argument("--batches", type=int, default=2000)
    for name in ("_memory", "_prefill"):
        w = sub.add_parser(name)
        w.add_argument("--mode", default="mapped")
        w.add_argument("--text", required=True)
        w.add_argument("--prepared", required=True)
        w.add_argument("--cache", required=True)
        w.add_argument("--batches", type=int, default=2000)
    s = sub.add_parser("steps")
    s.add_argument("--prepared", required=True)
    s.add_argument("--name", required=True)
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench-data"))
    f = sub.add_parser("first-step")
    f.add_argument("--prepared", nargs="+", required=True)
    f.add_argument("--repeats", type=int, default=3)
    f.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench-data"))
    sub.add_parser("report")
    args = parser.parse_args(argv)
    if args.cmd == "corpus":
        print(json.dumps(make_corpus(int(args.bytes), Path(args.out))))
    elif args.cmd == "prepare":
        _save(f"prepare-{args.name}", bench_prepare(args.dataset, args.out))
    elif args.cmd == "memory":
        _save(f"memory-{args.label}", bench_memory(args.text, args.prepared, args.label, args.batches))
    elif args.cmd == "_memory":
        print(json.dumps(memory_worker(args.mode, args.text, args.prepared, args.cache, args.batches)))
    elif args.cmd == "_prefill":  # also by hand, before `memory`: python bench_data.py _prefill --text ... --cache C
        prefill_today(args.text, args.prepared, args.cache)
    elif args.cmd == "steps":
        _save(f"steps-{args.name}", bench_steps(args.prepared, args.steps, args.repeats, Path(args.work)))
    elif args.cmd == "first-step":
        _save("first-step", bench_first_step(args.prepared, args.repeats, Path(args.work)))
    else:
        report()


if __name__ == "__main__":
    main()
