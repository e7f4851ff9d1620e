"""A sandbox per kernel: Linux namespaces through bubblewrap (where installed) or ``unshare``.

The package, one concept a file: :mod:`.backend` (the backends and the command that starts a
process in a sandbox, the limits, the per-batch area), :mod:`.probe` (which backend isolates here,
checked once per batch), :mod:`.reach` (whether a job's uid reaches what it needs, before the first
job), :mod:`.home` (the environment and private home inside), :mod:`.kernel` (the Jupyter kernel
manager that starts kernels in it), :mod:`.procs` (every process of a job, tagged, found and killed
when the job ends), and the two programs run inside, standard library only: :mod:`.drop` (least
privilege first) and :mod:`.init` (the file system of an ``unshare`` sandbox).

Everything student code runs in (the Jupyter kernel nbgrader drives, and the confirmation run,
:mod:`autograder.confirm`) is started through :func:`command`. Inside, the process sees:

* read-only: the interpreter and its installed packages, the system's libraries, and the
  *pristine* minidist (a copy made when the batch starts, see :func:`pristine_minidist`);
* read-write: its private working folder (and, for a kernel, its connection folder), a private
  ``/tmp``. A kernel's working folder is a copy of the *submitted* folder, mounted at the path
  nbgrader gives it: nbgrader's own folder holds the notebook being graded with the hidden
  tests already written back in, which a student cell could otherwise simply open;
* nothing else: not ``solutions/``, not ``autograder/``, not the repository, no other job, no
  grader records, no network (a new network namespace with only loopback), no other process
  (a new PID namespace: when the sandbox's first process exits, everything in it dies);
* no privilege: :mod:`autograder.sandbox.drop` sets the job's limits and, when the grader runs
  as root, switches to the job's own unprivileged uid *before* the user namespace exists, so the
  sandbox's users map to that uid and never to the machine's root; inside, the submission is uid
  1000 with no capability and ``no_new_privs``; ``/sys`` and ``/proc/sys`` are read-only all the
  way down and ``/dev`` is a fresh minimal one (see :data:`GUARANTEES`).

Whatever a sandboxed process must read or write has to be reachable by that uid: the grader keeps
it in a per-batch *area* (:func:`make_area`, traversable by anyone, each job's folder its own uid's).

:func:`probe` runs once per batch and says which backend works here; where none does, the
grader says so once per batch and in every row of ``results.csv``.
"""
