"""Lab 10 (distributed checkpointing: sharded save, load under another layout, the newest good
checkpoint): realistic wrong implementations, and correct alternatives to the solution that must get
full marks.

Each bug edits one solution cell of solutions/lab10_checkpointing/lab10_checkpointing.ipynb and names
the test cells that must lose points; each alternative rewrites one solution cell correctly (format:
solutions/BUGBANK.md). The three checks are independent: each starts from checkpoints the
library writes (minidist.checkpoint.portable), so a wrong save fails its own test only.
"""

SAVE = "test_save_sharded"
LOAD = "test_load_resharded"
LOAD_DEVICE = "test_load_resharded_device"
LATEST = "test_latest_checkpoint"

BUGS = [
    # ------------------------------------------------------------------ save_sharded
    dict(
        name="save_in_place",
        cell="save_sharded",
        replace=[('    tmp = path + ".tmp"\n', "    tmp = path\n"),
                 ("os.rename(tmp, path)                     # the commit: one atomic step", "pass")],
        catches=[SAVE],
        why="writes straight into path: a crash in the middle leaves a torn checkpoint a restart could load",
    ),
    dict(
        name="save_replica_by_every_rank",
        cell="save_sharded",
        replace=[('if (layout["kind"] == "replicated" and rank > 0) or 0 in lengths:', "if 0 in lengths:")],
        catches=[SAVE],
        why="every data-parallel rank writes the replica: N copies, N times the bytes, overlapping shards",
    ),
    dict(
        name="save_even_split",
        cell="save_sharded",
        replace=[("            offsets, lengths = box(full.shape, layout, rank)\n",
                  "            offsets, lengths = box(full.shape, layout, rank)\n"
                  "            if layout[\"kind\"] == \"rows\":\n"
                  "                per = full.shape[0] // layout[\"world\"]\n"
                  "                offsets, lengths = [rank * per] + offsets[1:], [per] + lengths[1:]\n")],
        catches=[SAVE],
        why="n // N rows per rank: with 7 rows over 4 ranks the last 3 rows are never written (hidden)",
    ),
    dict(
        name="save_checksum_of_tensors",
        cell="save_sharded",
        replace=[('"sha256": sha256_of(os.path.join(tmp, fname))}',
                  '"sha256": __import__("hashlib").sha256(b"".join(t.numpy().tobytes() for t in tensors.values())).hexdigest()}')],
        catches=[SAVE],
        why="hashes the tensors' bytes, not the file: a reader checking the file against it refuses every checkpoint",
    ),
    dict(
        name="save_metadata_after_rename",
        cell="save_sharded",
        replace=[("""    with open(os.path.join(tmp, "metadata.json"), "w") as f:    # last: its presence means complete
        json.dump(meta, f)
    os.rename(tmp, path)                     # the commit: one atomic step""",
                  """    os.rename(tmp, path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(meta, f)""")],
        catches=[SAVE],
        why="renames, then writes metadata.json: a crash between the two leaves path without its metadata",
    ),
    # ------------------------------------------------------------------ load_resharded
    dict(
        name="load_assemble_then_slice",
        cell="load_resharded",
        code='''def load_resharded(path, layout, rank):
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"torn checkpoint: {os.path.join(path, 'metadata.json')} does not exist")
    meta = json.load(open(os.path.join(path, "metadata.json")))
    out = {}
    for name, t in meta["tensors"].items():
        full = torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]), device="cpu")
        for s in t["shards"]:
            with safe_open(os.path.join(path, s["file"]), framework="pt") as f:
                full[tuple(slice(o, o + n) for o, n in zip(s["offsets"], s["lengths"]))] = f.get_tensor(name)
        off, ln = box(tuple(t["shape"]), layout, rank)
        out[name] = full[tuple(slice(o, o + n) for o, n in zip(off, ln))].clone()
    return out
''',
        catches=[LOAD],
        why="rebuilds every full tensor from every file, then slices its piece: opens files that hold nothing of "
            "it (and a torn checkpoint raises FileNotFoundError)",
    ),
    dict(
        name="load_opens_touching_shards",
        cell="load_resharded",
        replace=[("if any(h <= l for l, h in zip(lo, hi)):", "if any(h < l for l, h in zip(lo, hi)):")],
        catches=[LOAD],
        why="opens a shard whose box only touches its own (hi == lo): a file read for nothing",
    ),
    dict(
        name="load_torn_filenotfound",
        cell="load_resharded",
        replace=[('    if not os.path.exists(meta_path):\n'
                  '        raise ValueError(f"{meta_path} is missing: a torn checkpoint (the metadata is written last)")\n',
                  "")],
        catches=[LOAD],
        why="no check for a torn checkpoint: open() raises FileNotFoundError where the text asks for a ValueError",
    ),
    dict(
        name="load_same_layout_assumed",
        cell="load_resharded",
        code='''def load_resharded(path, layout, rank):
    meta_path = os.path.join(path, "metadata.json")
    if not os.path.exists(meta_path):
        raise ValueError(f"{meta_path} is missing: a torn checkpoint")
    with open(meta_path) as f:
        meta = json.load(f)
    out = {}
    with safe_open(os.path.join(path, f"rank{rank}.safetensors"), framework="pt") as f:
        for name in meta["tensors"]:
            out[name] = f.get_tensor(name)       # my own file: right only if nothing changed
    return out
''',
        catches=[LOAD],
        why="reads its own rank's file: correct only when the checkpoint was saved under the same layout",
    ),
    dict(
        name="load_pieces_without_device",
        cell="load_resharded",
        replace=[('mine = torch.empty(lengths, dtype=getattr(torch, t["dtype"]), device="cpu")',
                  'mine = torch.empty(lengths, dtype=getattr(torch, t["dtype"]))')],
        catches=[LOAD_DEVICE],
        why="the pieces are made without device=\"cpu\": right on a laptop, on the GPU (or meta) a process set "
            "as its default device on a node, not in host memory (only the device check sees it)",
    ),
    dict(
        name="load_slices_on_default_device",
        cell="load_resharded",
        replace=[('with torch.device("cpu"), safe_open(', "with safe_open(")],
        catches=[LOAD_DEVICE],
        why="the slices are read outside torch.device(\"cpu\"): safetensors makes them on the default device, "
            "so under a GPU (or meta) default the copy into the host piece reads from another device",
    ),
    dict(
        name="load_torn_returns_empty",
        cell="load_resharded",
        replace=[('        raise ValueError(f"{meta_path} is missing: a torn checkpoint (the metadata is written last)")',
                  "        return {}")],
        catches=[LOAD],
        why="a torn checkpoint loads as nothing, silently: training restarts from random weights",
    ),
    dict(
        name="load_overlap_not_clipped",
        cell="load_resharded",
        replace=[("src = f.get_slice(name)[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, s[\"offsets\"]))]",
                  "src = f.get_slice(name)[tuple(slice(l - o, l - o + (h - l)) for l, h, o in zip(lo, hi, offsets))]")],
        catches=[LOAD],
        why="reads the overlap at my offsets instead of the shard's: the wrong rows whenever the layouts differ",
    ),
    dict(
        name="load_torn_keyerror",
        cell="load_resharded",
        replace=[('    if not os.path.exists(meta_path):\n'
                  '        raise ValueError(f"{meta_path} is missing: a torn checkpoint (the metadata is written last)")\n',
                  '    if not os.path.exists(meta_path):\n'
                  '        raise KeyError("tensors")\n')],
        catches=[LOAD],
        why="fails on a torn checkpoint with an error that does not say which file is missing",
    ),
    # ------------------------------------------------------------------ latest_checkpoint
    dict(
        name="latest_sorted_by_name",
        cell="latest_checkpoint",
        replace=[("for _, d in sorted(steps, reverse=True):", "for d in sorted((d for _, d in steps), reverse=True):")],
        catches=[LATEST],
        why="newest by name: 'step_9' sorts after 'step_10'",
    ),
    dict(
        name="latest_metadata_only",
        cell="latest_checkpoint",
        replace=[("""            good = all(os.path.exists(os.path.join(path, name))
                       and os.path.getsize(os.path.join(path, name)) == rec["bytes"]
                       and sha256_of(os.path.join(path, name)) == rec["sha256"]
                       for name, rec in meta["files"].items())""", "            good = isinstance(meta, dict)")],
        catches=[LATEST],
        why="trusts metadata.json alone: a truncated file is loaded",
    ),
    dict(
        name="latest_size_not_checksum",
        cell="latest_checkpoint",
        replace=[("""                       and sha256_of(os.path.join(path, name)) == rec["sha256"]\n""", "")],
        catches=[LATEST],
        why="checks sizes, not checksums: a corrupted byte goes unnoticed",
    ),
    dict(
        name="latest_takes_tmp",
        cell="latest_checkpoint",
        replace=[('m = re.fullmatch(r"step_(\\d+)", d)', 'm = re.match(r"step_(\\d+)", d)')],
        catches=[LATEST],
        why="a crashed save's step_3.tmp counts as step 3",
    ),
    dict(
        name="latest_newest_mtime",
        cell="latest_checkpoint",
        replace=[("for _, d in sorted(steps, reverse=True):",
                  "for _, d in sorted(steps, key=lambda s: os.path.getmtime(os.path.join(root, s[1])), reverse=True):")],
        catches=[LATEST],
        why="newest by modification time: a smaller step written later wins",
    ),
    dict(
        name="latest_files_found_not_listed",
        cell="latest_checkpoint",
        replace=[("""            good = all(os.path.exists(os.path.join(path, name))
                       and os.path.getsize(os.path.join(path, name)) == rec["bytes"]
                       and sha256_of(os.path.join(path, name)) == rec["sha256"]
                       for name, rec in meta["files"].items())""",
                  """            good = all(os.path.getsize(os.path.join(path, name)) == meta["files"][name]["bytes"]
                       and sha256_of(os.path.join(path, name)) == meta["files"][name]["sha256"]
                       for name in os.listdir(path) if name in meta["files"])""")],
        catches=[LATEST],
        why="checks the files it finds, not the files the metadata lists: a deleted shard goes unnoticed",
    ),
]

ALTERNATIVES = [
    dict(
        name="save_mkdtemp_replace",
        cell="save_sharded",
        code='''def save_sharded(state, layout, path):
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        by_rank, meta = {}, {"tensors": {}, "files": {}}
        for name, full in dict(state).items():
            entry = meta["tensors"][name] = {"shape": list(full.shape),
                                             "dtype": str(full.dtype).split(".")[-1], "shards": []}
            owners = [0] if layout["kind"] == "replicated" else range(layout["world"])
            for r in owners:
                off, ln = box(tuple(full.shape), layout, r)
                if min(ln, default=1) == 0:
                    continue
                by_rank.setdefault(r, {})[name] = full[tuple(slice(o, o + n) for o, n in zip(off, ln))].clone()
                entry["shards"].append({"rank": r, "file": f"rank{r}.safetensors", "offsets": list(off),
                                        "lengths": list(ln)})
        for r in sorted(by_rank):
            f = os.path.join(tmp, f"rank{r}.safetensors")
            save_file(by_rank[r], f)
            meta["files"][os.path.basename(f)] = {"bytes": os.stat(f).st_size, "sha256": sha256_of(f)}
        with open(os.path.join(tmp, "metadata.json"), "w") as f:
            f.write(json.dumps(meta))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
''',
        why="a private temporary directory (tempfile.mkdtemp) removed on failure, fsync, os.replace",
    ),
    dict(
        name="save_rank_major",
        cell="save_sharded",
        code='''def save_sharded(state, layout, path):
    tmp = path + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    names = list(state)
    shards = {name: [] for name in names}
    files = {}
    for r in range(layout["world"]):             # each rank in turn writes its own file, as on a real job
        mine = {}
        for name in names:
            t = state[name]
            off, ln = box(t.shape, layout, r)
            owner = layout["kind"] != "replicated" or r == 0
            if owner and all(n > 0 for n in ln):
                mine[name] = t[tuple(slice(o, o + n) for o, n in zip(off, ln))].contiguous()
                shards[name].append({"rank": r, "file": f"rank{r}.safetensors", "offsets": off, "lengths": ln})
        if mine:
            f = os.path.join(tmp, f"rank{r}.safetensors")
            save_file(mine, f)
            files[f"rank{r}.safetensors"] = {"bytes": os.path.getsize(f), "sha256": sha256_of(f)}
    tensors = {name: {"shape": list(state[name].shape), "dtype": str(state[name].dtype).replace("torch.", ""),
                      "shards": shards[name]} for name in names}
    with open(os.path.join(tmp, "metadata.json"), "w") as f:
        json.dump({"tensors": tensors, "files": files}, f, indent=1)
    os.rename(tmp, path)
''',
        why="rank by rank, each writing its own file (as each rank would on a job), then the metadata",
    ),
    dict(
        name="load_file_cached",
        cell="load_resharded",
        code='''def load_resharded(path, layout, rank):
    from safetensors.torch import load_file
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            meta = json.load(f)
    except FileNotFoundError as err:
        raise ValueError(f"torn checkpoint: {err.filename} (metadata.json) is missing") from None
    out, cache = {}, {}
    for name, t in meta["tensors"].items():
        off, ln = box(t["shape"], layout, rank)
        piece = torch.empty(ln, dtype=getattr(torch, t["dtype"]), device="cpu")
        for s in t["shards"]:
            ends = [(max(a, b), min(a + n, b + m)) for a, n, b, m in zip(off, ln, s["offsets"], s["lengths"])]
            if any(hi <= lo for lo, hi in ends):
                continue
            if s["file"] not in cache:
                cache[s["file"]] = load_file(os.path.join(path, s["file"]), device="cpu")
            src = cache[s["file"]][name]
            piece[tuple(slice(lo - a, hi - a) for (lo, hi), a in zip(ends, off))] = \\
                src[tuple(slice(lo - b, hi - b) for (lo, hi), b in zip(ends, s["offsets"]))]
        out[name] = piece
    return out
''',
        why="each needed file read whole once (load_file) and kept; a torn checkpoint's FileNotFoundError turned "
            "into the ValueError",
    ),
    dict(
        name="load_under_cpu_default",
        cell="load_resharded",
        code='''def load_resharded(path, layout, rank):
    if not os.path.exists(os.path.join(path, "metadata.json")):
        raise ValueError(f"torn checkpoint at {path}: no metadata.json")
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    out = {}
    with torch.device("cpu"):                # everything below is made in host memory
        for name, t in meta["tensors"].items():
            off, ln = box(t["shape"], layout, rank)
            piece = torch.zeros(ln, dtype=getattr(torch, t["dtype"]))
            for s in t["shards"]:
                lo = [max(a, b) for a, b in zip(off, s["offsets"])]
                hi = [min(a + n, b + m) for a, n, b, m in zip(off, ln, s["offsets"], s["lengths"])]
                if all(l < h for l, h in zip(lo, hi)):
                    with safe_open(os.path.join(path, s["file"]), framework="pt") as f:
                        piece[tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, off))] = \\
                            f.get_slice(name)[tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, s["offsets"]))]
            out[name] = piece
    return out
''',
        why="the whole load under torch.device(\"cpu\"): pieces and slices made in host memory without device=",
    ),
    dict(
        name="load_narrow",
        cell="load_resharded",
        code='''def load_resharded(path, layout, rank):
    meta_file = os.path.join(path, "metadata.json")
    try:
        with open(meta_file) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"cannot load {path}: metadata.json is missing (torn checkpoint)") from None
    pieces = {}
    for name, t in meta["tensors"].items():
        off, ln = box(t["shape"], layout, rank)
        piece = torch.zeros(ln, dtype=getattr(torch, t["dtype"]), device="cpu")
        for s in t["shards"]:
            region = []
            for a, n, b, m in zip(off, ln, s["offsets"], s["lengths"]):
                lo, hi = max(a, b), min(a + n, b + m)
                region.append((lo, hi))
            if not all(lo < hi for lo, hi in region):
                continue
            with safe_open(os.path.join(path, s["file"]), framework="pt") as f:
                src = f.get_tensor(name)
            dst = piece
            for d, ((lo, hi), a, b) in enumerate(zip(region, off, s["offsets"])):
                src = src.narrow(d, lo - b, hi - lo)
                dst = dst.narrow(d, lo - a, hi - lo)
            dst.copy_(src)
        pieces[name] = piece
    return pieces
''',
        why="narrow() dimension by dimension, copy_ into a view of the piece",
    ),
    dict(
        name="latest_listdir_sorted_key",
        cell="latest_checkpoint",
        code='''def _good(path):
    try:
        meta = json.load(open(os.path.join(path, "metadata.json")))
        for name, rec in meta["files"].items():
            f = os.path.join(path, name)
            if os.path.getsize(f) != rec["bytes"] or sha256_of(f) != rec["sha256"]:
                return False
        return True
    except Exception:
        return False


def latest_checkpoint(root):
    names = [d for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit()]
    for d in sorted(names, key=lambda d: int(d[5:]), reverse=True):
        if _good(os.path.join(root, d)):
            return os.path.join(root, d)
    return None
''',
        why="a helper that says whether a directory is good, names filtered with isdigit",
    ),
    dict(
        name="latest_max_of_good",
        cell="latest_checkpoint",
        code='''def latest_checkpoint(root):
    good = []
    for d in os.listdir(root):
        if not re.fullmatch(r"step_[0-9]+", d):
            continue
        p = os.path.join(root, d)
        try:
            with open(os.path.join(p, "metadata.json")) as f:
                files = json.load(f)["files"]
        except (OSError, json.JSONDecodeError, KeyError):
            continue
        if all(os.path.isfile(os.path.join(p, n)) and os.path.getsize(os.path.join(p, n)) == r["bytes"]
               and sha256_of(os.path.join(p, n)) == r["sha256"] for n, r in files.items()):
            good.append((int(d.split("_")[1]), p))
    return max(good)[1] if good else None
''',
        why="verifies every candidate, then takes the largest step",
    ),
]

INTERVAL, GOODPUT = "test_checkpoint_interval", "test_goodput"

BUGS += [
    dict(name="interval_gpu_mtbf", cell="checkpoint_interval",
         replace=[("mtbf = gpu_mtbf_s / gpus", "mtbf = gpu_mtbf_s")], catches=[INTERVAL],
         why="the per-GPU MTBF used as the job's: intervals √N times too long"),
    dict(name="interval_young_without_2", cell="checkpoint_interval",
         replace=[("young = math.sqrt(2 * save_s * mtbf)", "young = math.sqrt(save_s * mtbf)")], catches=[INTERVAL],
         why="√(C·M): Young's interval without its factor 2"),
    dict(name="interval_daly_without_minus_c", cell="checkpoint_interval",
         replace=[("daly = young * (1 + math.sqrt(x) / 3 + x / 9) - save_s", "daly = young * (1 + math.sqrt(x) / 3 + x / 9)")],
         catches=[INTERVAL], why="Daly's formula without its final − C"),
    dict(name="interval_daly_always_formula", cell="checkpoint_interval",
         replace=[("    if save_s >= 2 * mtbf:\n", "    if False:\n")], catches=[INTERVAL],
         why="Daly's formula where C >= 2M, where Daly's optimum is M (hidden)"),
    dict(name="goodput_blocking_ignored", cell="goodput",
         replace=[("stall = save_s if blocking_s is None else blocking_s", "stall = save_s")], catches=[GOODPUT],
         why="an asynchronous save counted as stalling training for all of C"),
    dict(name="goodput_no_restart", cell="goodput",
         replace=[(" - restart_s / mtbf_s\n", "\n")], catches=[GOODPUT],
         why="the restart's R/M left out"),
    dict(name="goodput_lost_tau_only", cell="goodput",
         replace=[("(interval_s + save_s) / (2 * mtbf_s)", "interval_s / (2 * mtbf_s)")], catches=[GOODPUT],
         why="τ/(2M) for the work a failure loses, without the save in progress"),
    dict(name="goodput_negative", cell="goodput",
         replace=[("return max(0.0, kept)", "return kept")], catches=[GOODPUT],
         why="no floor at 0: a negative share of wall time (hidden)"),
]

ALTERNATIVES += [
    dict(name="interval_pow_and_ratio", cell="checkpoint_interval",
         code='''def checkpoint_interval(save_s, gpu_mtbf_s, gpus):
    m = gpu_mtbf_s / gpus
    r = save_s / (2 * m)
    young = (2 * save_s * m) ** 0.5
    daly = m if r >= 1 else young + young * r ** 0.5 / 3 + young * r / 9 - save_s
    return dict(mtbf_s=m, young_s=young, daly_s=daly)
''',
         why="** 0.5 and the ratio C/(2M), Daly's terms expanded"),
    dict(name="interval_rate_sum", cell="checkpoint_interval",
         code='''def checkpoint_interval(save_s, gpu_mtbf_s, gpus):
    rate = gpus * (1.0 / gpu_mtbf_s)          # failures per second, all GPUs together
    mtbf = 1.0 / rate
    young = math.sqrt(2.0 * save_s * mtbf)
    x = save_s / (2.0 * mtbf)
    daly = mtbf if save_s >= 2.0 * mtbf else math.sqrt(2.0 * save_s * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - save_s
    return {"daly_s": float(daly), "young_s": float(young), "mtbf_s": float(mtbf)}
''',
         why="the job's failure rate as the sum of the GPUs' rates"),
    dict(name="goodput_terms", cell="goodput",
         code='''def goodput(interval_s, save_s, mtbf_s, restart_s=0.0, blocking_s=None):
    stalled = (save_s if blocking_s is None else blocking_s) / interval_s
    redone = (interval_s + save_s) / 2 / mtbf_s
    restarting = restart_s / mtbf_s
    return max(1.0 - stalled - redone - restarting, 0.0)
''',
         why="each loss named, then the floor"),
    dict(name="goodput_if_negative", cell="goodput",
         code='''def goodput(interval_s, save_s, mtbf_s, restart_s=0.0, blocking_s=None):
    if blocking_s is None:
        blocking_s = save_s
    g = 1 - blocking_s / interval_s - (interval_s + save_s) / (2 * mtbf_s) - restart_s / mtbf_s
    if g < 0:
        g = 0.0
    return g
''',
         why="the default filled in, an if for the floor"),
]

ASYNC = "test_async_saver"

BUGS += [
    dict(name="async_no_copy", cell="async_saver",
         replace=[('copy = {name: t.detach().to("cpu", copy=True) for name, t in state.items()}', "copy = dict(state)")],
         catches=[ASYNC], why="writes the live tensors: the next step changes them while the thread writes"),
    dict(name="async_cpu_aliases", cell="async_saver",
         replace=[('copy = {name: t.detach().to("cpu", copy=True) for name, t in state.items()}',
                   'copy = {name: t.detach().cpu() for name, t in state.items()}')],
         catches=[ASYNC], why=".cpu() copies from a GPU but returns the same tensor on the CPU: the write sees the next "
                              "step's values"),
    dict(name="async_blocking", cell="async_saver",
         replace=[("        self.thread = threading.Thread(target=run, daemon=True)\n        self.thread.start()\n",
                   "        run()\n")],
         catches=[ASYNC], why="writes on the calling thread: training waits for the whole write"),
    dict(name="async_no_wait_before_next", cell="async_saver",
         replace=[("        self.wait()                                  # one save at a time; a failure surfaces here\n",
                   "")],
         catches=[ASYNC], why="starts the next write while the previous one runs: two writes at once, and a failure "
                              "never surfaces at the next save"),
    dict(name="async_error_swallowed", cell="async_saver",
         replace=[("                self.error = err", "                print('background save failed:', err)")],
         catches=[ASYNC], why="a failed background write is printed, not raised: the job believes it has a checkpoint"),
    dict(name="async_error_raised_forever", cell="async_saver",
         replace=[("            err, self.error = self.error, None\n            raise err",
                   "            raise self.error")],
         catches=[ASYNC], why="the failure is kept: every later wait() and save() raises it again"),
]

ALTERNATIVES += [
    dict(name="async_executor", cell="async_saver",
         code='''from concurrent.futures import ThreadPoolExecutor


class AsyncSaver:
    def __init__(self, write):
        self._write = write
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._pending = None

    def save(self, state, *args):
        self.wait()
        host = {k: torch.empty_like(v, device="cpu").copy_(v) for k, v in state.items()}
        self._pending = self._pool.submit(self._write, host, *args)

    def wait(self):
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()          # re-raises the write's exception, once (the future is dropped)
''',
         why="a one-worker ThreadPoolExecutor; Future.result() raises the write's error"),
    dict(name="async_thread_subclass", cell="async_saver",
         code='''class _Writer(threading.Thread):
    def __init__(self, write, state, args):
        super().__init__(daemon=True)
        self.write, self.state, self.args, self.failure = write, state, args, None

    def run(self):
        try:
            self.write(self.state, *self.args)
        except Exception as e:
            self.failure = e


class AsyncSaver:
    def __init__(self, write):
        self.write = write
        self.writer = None

    def wait(self):
        writer, self.writer = self.writer, None
        if writer is None:
            return None
        writer.join()
        if writer.failure is not None:
            raise writer.failure

    def save(self, state, *args):
        self.wait()
        snapshot = {}
        for name in state:
            snapshot[name] = state[name].detach().clone().cpu()
        self.writer = _Writer(self.write, snapshot, args)
        self.writer.start()
''',
         why="a Thread subclass that keeps its failure; clone() then cpu()"),
]

RESTART = "test_train_resumable"

BUGS += [
    dict(name="restart_torch_rng_lost", cell="train_resumable",
         replace=[('        torch.set_rng_state(state["rng"]["torch"])     # the relaunch seeded them afresh: put back the run\'s\n',
                   "")],
         catches=[RESTART], why="torch's random state saved but not put back: the resumed run's dropout masks are step 1's again"),
    dict(name="restart_python_rng_lost", cell="train_resumable",
         replace=[('        random.setstate(state["rng"]["python"])\n', "")],
         catches=[RESTART], why="Python's random state not restored: the flips after the restart are the fresh run's"),
    dict(name="restart_numpy_rng_lost", cell="train_resumable",
         replace=[('        np.random.set_state(state["rng"]["numpy"])\n', "")],
         catches=[RESTART], why="numpy's random state not restored: the noise after the restart is the fresh run's"),
    dict(name="restart_torch_rng_only", cell="train_resumable",
         replace=[('        random.setstate(state["rng"]["python"])\n        np.random.set_state(state["rng"]["numpy"])\n', ""),
                  ('"rng": {"torch": torch.get_rng_state(), "python": random.getstate(),\n'
                   '                                   "numpy": np.random.get_state()}})',
                   '"rng": {"torch": torch.get_rng_state()}})')],
         catches=[RESTART], why="saves torch's generator alone, as if torch drew every random number of the step"),
    dict(name="restart_sampler_lost", cell="train_resumable",
         replace=[('        sampler.load_state_dict(state["sampler"])\n', "")],
         catches=[RESTART], why="the data position not restored: the resumed run takes the epoch's first batches again"),
    dict(name="restart_optimizer_lost", cell="train_resumable",
         replace=[('        optimizer.load_state_dict(state["optimizer"])\n', "")],
         catches=[RESTART], why="the weights restored but not Adam's moments and step: a fresh Adam after every restart"),
    dict(name="restart_scaler_lost", cell="train_resumable",
         replace=[('        if scaler is not None:\n            scaler.load_state_dict(state["scaler"])\n', "")],
         catches=[RESTART], why="the loss scaler starts again from its initial scale after a restart"),
    dict(name="restart_scaler_none_unguarded", cell="train_resumable",
         replace=[('        if scaler is not None:\n            scaler.load_state_dict(state["scaler"])\n',
                   '        scaler.load_state_dict(state["scaler"])\n'),
                  ('"scaler": scaler.state_dict() if scaler is not None else None,', '"scaler": scaler.state_dict(),')],
         catches=[RESTART], why="assumes a loss scaler: a run without one (scaler=None) fails at its first save (hidden)"),
    dict(name="restart_from_scratch", cell="train_resumable",
         replace=[("    resumed = store.latest()\n", "    resumed = None\n")],
         catches=[RESTART], why="saves but never resumes: every relaunch starts over from step 0 (ends equal, resumes nothing)"),
    dict(name="restart_steps_from_zero", cell="train_resumable",
         replace=[("    for n in range(start + 1, steps + 1):", "    for n in range(1, steps + 1):")],
         catches=[RESTART], why="restores the state, then counts the steps from 0 again: the steps before the checkpoint run twice"),
    dict(name="restart_skips_a_step", cell="train_resumable",
         replace=[("        start, state = resumed\n", "        saved_at, state = resumed\n        start = saved_at + 1\n")],
         catches=[RESTART], why="resumes at the checkpoint's step + 1 as if the label were the step that ran last: one "
                                "step lost per restart"),
    dict(name="restart_redoes_the_step", cell="train_resumable",
         replace=[("    for n in range(start + 1, steps + 1):", "    for n in range(max(start, 1), steps + 1):")],
         catches=[RESTART], why="resumes at the checkpoint's own step: the step it holds runs twice"),
    dict(name="restart_save_before_step", cell="train_resumable",
         replace=[("""        training_step(model, optimizer, scaler, sampler.next_batch(), group)
        if n % every == 0:""", """        if n % every == 0:"""),
                  ("""                                   "numpy": np.random.get_state()}})
    return start""", """                                   "numpy": np.random.get_state()}})
        training_step(model, optimizer, scaler, sampler.next_batch(), group)
    return start""")],
         catches=[RESTART], why="saves before the step runs: checkpoint n holds the state after n - 1 steps, and a resume "
                                "skips step n"),
    dict(name="restart_label_is_step_index", cell="train_resumable",
         replace=[("            store.save(n, {", "            store.save(n - 1, {")],
         catches=[RESTART], why="labels the checkpoint with the 0-based index of the step just run, not the steps done"),
    dict(name="restart_step_counted_per_run", cell="train_resumable",
         replace=[("""    for n in range(start + 1, steps + 1):             # step n: after it, n steps are done
        training_step(model, optimizer, scaler, sampler.next_batch(), group)
        if n % every == 0:
            store.save(n, {""", """    for i in range(steps - start):
        training_step(model, optimizer, scaler, sampler.next_batch(), group)
        if (i + 1) % every == 0:
            store.save(i + 1, {""")],
         catches=[RESTART], why="counts the steps of this run, not the job's: after a restart the checkpoints' labels "
                                "are wrong"),
    dict(name="restart_returns_nothing", cell="train_resumable",
         replace=[("\n    return start", "")],
         catches=[RESTART], why="returns None: the caller cannot tell a resume from a fresh start"),
]

ALTERNATIVES += [
    dict(name="restart_tuple_and_deep_copies", cell="train_resumable",
         code='''import copy


def train_resumable(model, optimizer, scaler, sampler, store, steps, every, group=None):
    found = store.latest()
    done = 0
    if found:
        done, (weights, opt_state, scaler_state, position, rngs) = found
        model.load_state_dict(weights)
        optimizer.load_state_dict(opt_state)
        sampler.load_state_dict(position)
        if scaler_state is not None:
            scaler.load_state_dict(scaler_state)
        torch.random.set_rng_state(rngs[0])
        random.setstate(rngs[1])
        np.random.set_state(rngs[2])
    first = done
    while done < steps:
        training_step(model, optimizer, scaler, sampler.next_batch(), group)
        done += 1
        if done % every == 0:
            rngs = [torch.random.get_rng_state(), random.getstate(), np.random.get_state()]
            store.save(done, (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()),
                              None if scaler is None else dict(scaler.state_dict()), dict(sampler.state_dict()), rngs))
    return first
''',
         why="the state as a tuple, the random states as a list, deep copies, a while loop counting the steps done"),
    dict(name="restart_saves_at_the_top", cell="train_resumable",
         code='''def train_resumable(model, optimizer, scaler, sampler, store, steps, every, group=None):
    def snapshot():
        out = {"model": model.state_dict(), "optim": optimizer.state_dict(), "data": sampler.state_dict(),
               "torch_rng": torch.get_rng_state().clone(), "py_rng": random.getstate(),
               "np_rng": np.random.get_state()}
        if scaler is not None:
            out["scaler"] = scaler.state_dict()
        return out

    latest = store.latest()
    step = 0 if latest is None else latest[0]
    begin = step
    if latest is not None:
        state = latest[1]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
        np.random.set_state(state["np_rng"])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        sampler.load_state_dict(state["data"])
        if "scaler" in state:
            scaler.load_state_dict(state["scaler"])
    while True:
        if step > begin and step % every == 0:
            store.save(step, snapshot())          # the steps done so far, saved before the next one runs
        if step == steps:
            return begin
        training_step(model, optimizer, scaler, sampler.next_batch(), group)
        step += 1
''',
         why="saves at the top of the loop, before the next step, the scaler only when there is one, "
             "the random states restored first"),
]
