"""Lab 10's answers, the only code of its checks that calls student code: what the student's function
did on one case, as plain data. Each runs in this process, in the case's temporary root, which
``reference`` is (built by :mod:`.checkpoints` before the student's code runs, outside the refusal;
removed here): ``save_sharded`` on a state next to the previous checkpoint, then everything it left
on disk read back; in a crash case the disk fills up at one point of the save (reading the k-th
tensor, writing the k-th file, writing ``metadata.json``) or the rename fails; ``load_resharded``
on a checkpoint the library wrote, for every rank of the new layout, with the files each rank opens
observed; ``latest_checkpoint`` on a root of checkpoints, some of them damaged; ``AsyncSaver`` with a
``write`` of the checks' own; ``train_resumable`` on 2 launched ranks that the check kills and
relaunches (:func:`restarted`), the only answer whose student code runs on ranks."""
from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Mapping

import torch
import torch.distributed as dist

from minidist.checks.kit.compare import digest
from minidist.checks.kit.launch import check_timeout, launch_named, mark_case
from minidist.checks.kit.returned import foreign_part
from minidist.checks.lab10_checkpointing import async_saver, restart_kit, train_resumable
from minidist.checks.lab10_checkpointing.helpers import sha256_of
from minidist.checks.lab10_checkpointing.cases import state_of
from minidist.checks.lab10_checkpointing.faults import CRASH, failing, observed
from minidist.runtime import LaunchError


class _DiskFull(Mapping):
    """The state, except that reading tensor ``at`` fails the way a full disk fails a write."""

    def __init__(self, state: dict, at: str):
        self._state, self._at = state, at

    def __getitem__(self, name):
        if name == self._at:
            raise OSError(28, CRASH)
        return self._state[name]

    def __iter__(self):
        return iter(self._state)

    def __len__(self):
        return len(self._state)


def _error(err: BaseException) -> dict:
    return {"type": type(err).__name__, "message": str(err)[:300]}


def _checkpoint_dir(path: str) -> dict:
    """Everything a save left in ``path``: its files, the metadata, each file's true size and checksum,
    and every shard the metadata lists, read back (or why it could not be)."""
    out = {"files": sorted(os.listdir(path))}
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        return out | {"metadata_error": _error(err)}
    if foreign_part(meta) is not None or not isinstance(meta, dict):
        return out | {"metadata_error": {"type": "format", "message": "metadata.json does not hold a JSON object"}}
    out["metadata"] = meta
    out["on_disk"] = {f: {"bytes": os.path.getsize(os.path.join(path, f)), "sha256": sha256_of(os.path.join(path, f))}
                      for f in out["files"] if os.path.isfile(os.path.join(path, f))}
    read = {}
    from safetensors import safe_open
    for name, t in (meta.get("tensors") or {}).items():
        for i, shard in enumerate(t.get("shards", []) if isinstance(t, dict) else []):
            file = shard.get("file") if isinstance(shard, dict) else None
            where = f"{name}#{i}"
            if not isinstance(file, str) or os.path.basename(file) != file or file not in out["files"]:
                read[where] = {"error": f"the shard names file {file!r}, which is not in the checkpoint's directory"}
                continue
            try:
                with safe_open(os.path.join(path, file), framework="pt") as fh:
                    read[where] = {"tensor": fh.get_tensor(name)}
            except Exception as err:      # noqa: BLE001  (a file the student wrote may be anything)
                read[where] = {"error": f"{file}: {type(err).__name__}: {str(err)[:200]}"}
    return out | {"read": read}


def saved(fn, case, reference) -> dict:
    state = state_of(case)
    keep = {name: digest(t) for name, t in state.items()}
    with reference as root:
        previous, path = os.path.join(root, "step_1"), os.path.join(root, "step_2")
        before = {f: sha256_of(os.path.join(previous, f)) for f in os.listdir(previous)}
        given = _DiskFull(state, list(state)[case["crash_at"]]) if "crash_at" in case else dict(state)
        out = {"raised": None}
        try:
            with failing(fn, case.get("fail")):
                fn(given, dict(case["layout"]), path)
        except Exception as err:     # noqa: BLE001  (the crash case must raise; others must not)
            out["raised"] = _error(err)
        out["entries"] = sorted(os.listdir(root))
        out["previous_intact"] = before == {f: sha256_of(os.path.join(previous, f)) for f in os.listdir(previous)}
        if os.path.isdir(path):
            out["saved"] = _checkpoint_dir(path)
    out["given_unchanged"] = all(digest(t) == keep[n] for n, t in state.items())
    return out


def loaded(fn, case, reference) -> dict:
    with reference as root:
        path = os.path.join(root, "step_5")
        if case.get("torn"):
            try:
                fn(path, dict(case["load"]), 0)
            except Exception as err:      # noqa: BLE001
                return {"raised": _error(err)}
            return {"raised": None}
        pieces, opened, devices = [], [], []
        for r in range(case["load"]["world"]):
            mine = []
            with observed(fn, mine):
                got = fn(path, dict(case["load"]), r)
            opened.append(sorted(set(mine)))
            foreign = foreign_part(got)
            if foreign is not None or not isinstance(got, dict):
                return {"rank": r, "not plain": foreign or f"a {type(got).__name__}"}
            # where each piece is, as returned (a piece on ``meta`` has no data to compare: the device says it all)
            devices.append({k: str(v.device) for k, v in got.items() if isinstance(v, torch.Tensor)})
            pieces.append({k: (f"a tensor on {v.device}" if v.is_meta else v.detach().cpu().clone())
                           if isinstance(v, torch.Tensor) else v for k, v in got.items()})
    return {"pieces": pieces, "opened": opened, "devices": devices}


def chosen(fn, case, reference) -> dict:
    with reference as root:
        got = fn(root)
        if got is None:
            return {"returned": None}
        if not isinstance(got, (str, os.PathLike)):
            return {"returned_type": type(got).__name__}
        got = os.fspath(got)
        inside = os.path.dirname(os.path.abspath(got)) == os.path.abspath(root)
        return {"returned": os.path.basename(got) if inside else got, "inside_root": inside}


FAILED_WRITE = "No space left on device (injected: the background write failed)"
RELEASE_S = 1.5         # how long a write waits to be released: save() must have returned by then


class _Writes:
    """The ``write`` an AsyncSaver is given: records each call (its state, arguments, overlap); call k
    finishes only once ``releases[k]`` is set, or after RELEASE_S."""

    def __init__(self, fail: bool, saves: int):
        self.fail, self.calls, self.started, self.active, self.max_active = fail, [], 0, 0, 0
        self.releases, self.lock = [threading.Event() for _ in range(saves + 1)], threading.Lock()

    def __call__(self, state, *args):
        with self.lock:
            k = min(self.started, len(self.releases) - 1)
            self.started += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            self.releases[k].wait(RELEASE_S)
            written = {n: (v.detach().clone(), v.untyped_storage().data_ptr()) if isinstance(v, torch.Tensor) else v
                       for n, v in dict(state).items()}
            self.calls.append((written, [a if isinstance(a, (str, int, float)) else repr(a) for a in args]))
            if self.fail:
                raise OSError(28, FAILED_WRITE)
        finally:
            with self.lock:
                self.active -= 1

    def release_all(self):
        for event in self.releases:
            event.set()


def async_saved(fn, case) -> dict:
    """One scenario of ``AsyncSaver`` (:mod:`.async_saver`): saves of states that change right after
    each call, with the check's own ``write``; everything as plain data."""
    scenario = case["scenario"]
    saves = 2 if scenario in ("two", "fails_then_save") else 1
    writes = _Writes(fail=scenario.startswith("fails"), saves=saves)
    states = [async_saver.state_of(case, k) for k in range(saves)]
    storages = [{n: v.untyped_storage().data_ptr() for n, v in st.items()} for st in states]
    saver, out = fn(writes), {"raised": None, "failure": str(OSError(28, FAILED_WRITE))}
    try:
        if scenario in ("one", "two"):
            early = []
            # No write is released before the last save returned: a second save waits for the first write
            # until that one gives up waiting (RELEASE_S), and one that does not wait runs two writes at once.
            for k, state in enumerate(states):
                saver.save(state, f"step_{k}")
                early.append(len(writes.calls) == k)         # write k has not finished: it waits for its release
                for t in state.values():
                    t.add_(1)                       # the next step changes the state right after the call
            writes.release_all()
            out["waited"] = None
            try:
                saver.wait()
            except Exception as err:       # noqa: BLE001
                out["waited"] = _error(err)["type"]
            out |= {"returned_early": all(early), "args": [a for _, a in writes.calls],
                    "written": [{n: v[0] for n, v in w.items()} for w, _ in writes.calls],
                    "same_storage": [any(w[n][1] == storages[i].get(n) for n in w)
                                     for i, (w, _) in enumerate(writes.calls)]}
        else:
            writes.release_all()
            try:
                saver.save(states[0], "step_0")
                saver.wait() if scenario == "fails" else saver.save(states[1], "step_1")
            except Exception as err:      # noqa: BLE001  (the write's error must come out here)
                out["raised"] = _error(err)
            out["again"] = None
            try:
                saver.wait()
            except Exception as err:      # noqa: BLE001
                out["again"] = _error(err)["type"]
            out["writes"] = writes.started
    finally:
        writes.release_all()
    out["max_active"] = writes.max_active
    return out


RESTART_TIMEOUT = check_timeout(30.0, at_least=10.0)    # one attempt of 2 ranks, a few tiny steps
KILLED = 17             # the exit status of a rank the check kills (os._exit: no cleanup, no exception)


class _KillingSampler(restart_kit.Sampler):
    """The handed-out sampler, except that it kills this rank (``kill`` = k) as it is asked for the batch of
    step k (its position says which step's batch it is: the epochs' batches, counted)."""

    def __init__(self, rank: int, world: int, kill, marker: str):
        super().__init__(rank, world)
        self.kill, self.marker = kill, marker

    def next_batch(self):
        if self.kill is not None and self.epoch * (restart_kit.EXAMPLES // restart_kit.BATCH) \
                + self.position // restart_kit.BATCH == self.kill - 1:
            _die(self.marker)
        return super().next_batch()


class _KillingStore(restart_kit.Store):
    """The handed-out store, recording the steps saved, that kills this rank inside ``save(kill)``, after the
    write and before the rename."""

    def __init__(self, root: str, rank: int, world: int, kill, marker: str):
        super().__init__(root, rank, world)
        self.kill, self.marker, self.saved = kill, marker, []

    def written(self, step):
        if step == self.kill:
            _die(self.marker)
        self.saved.append(step)


def _die(marker: str) -> None:
    with open(marker, "w"):
        pass                                    # the answer counts the kills that happened
    os._exit(KILLED)


def _restart_rank(progress: str, fn, case: dict, root: str) -> dict:
    """Inside a rank, in every attempt: a fresh run built as a relaunched job builds it, the kill of this
    attempt set up where the case puts it, the student's ``train_resumable``, then what the run ends with."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(root, "attempt")) as f:
        attempt = int(f.read())
    mark_case(progress, f"{train_resumable.describe(case)}: run {attempt + 1}")
    kind, who, at = case["kills"][attempt] if attempt < len(case["kills"]) else (None, None, None)
    marker = os.path.join(root, f"killed-{attempt}")
    model, optimizer, scaler, _ = restart_kit.new_run(rank, world, case["scaler"])
    sampler = _KillingSampler(rank, world, at if (kind, who) == ("step", rank) else None, marker)
    store = _KillingStore(os.path.join(root, "store"), rank, world, at if (kind, who) == ("save", rank) else None,
                          marker)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))     # one forward per training step
    returned = fn(model, optimizer, scaler, sampler, store, case["steps"], case["every"], dist.group.WORLD)
    out = train_resumable.final_state(model, optimizer, scaler, sampler)     # the random states first: nothing drew since
    if foreign_part(returned) is not None:
        returned = f"<a {type(returned).__name__}>"      # read as what it is, never run here
    return out | {"returned": returned, "forwards": len(forwards), "saved": store.saved}


def restarted(fn, case, refusal) -> dict:
    """``train_resumable`` on 2 CPU ranks launched with a restart per kill of the case (the restarts of
    ``minidist.launch``); the refusal holds on the ranks, where the student's code runs. A failure that is
    not a kill of the check's ends the launch: its report (which names the case and the attempt) is the answer's
    error."""
    with tempfile.TemporaryDirectory(prefix="minidist-restart-") as root:
        def attempt(n: int) -> None:
            with open(os.path.join(root, "attempt"), "w") as f:
                f.write(str(n))

        def on_restart(n: int, err) -> None:
            if not os.path.exists(os.path.join(root, f"killed-{n - 1}")):
                raise err                       # the student's code failed, not a rank the check killed
            attempt(n)

        attempt(0)
        try:
            ranks = launch_named(_restart_rank, train_resumable.WORLD, fn, case, root, name="train_resumable",
                                 timeout=RESTART_TIMEOUT, refuse=refusal, ranks_on="cpu",
                                 max_restarts=len(case["kills"]), on_restart=on_restart)
        except (LaunchError, AssertionError) as err:     # a rank's failure; a library answer, refused on a rank
            return {"error": str(err)[:4000]}
        killed = sum(os.path.exists(os.path.join(root, f"killed-{n}")) for n in range(len(case["kills"])))
    return {"ranks": ranks, "killed": killed}
