"""The first process inside the sandbox: PID 1 of the run's PID namespace (bubblewrap's
``--as-pid-1``), run as ``python -I -S -c <this file's text> STATUS_FD LIMITS PROGRAM``.

Hand-written because bubblewrap cannot do either of its two jobs: set resource limits inside
the run's user namespace (there ``RLIMIT_NPROC`` counts only the run's processes, not all of the
caller's), and report the program's exact wait status (bubblewrap folds a death by signal N
into exit code 128+N, which a program can also exit with). It forks the program in the same
interpreter (no second start-up), reaps every orphan, writes ``started`` and then the program's
wait status to STATUS_FD, and exits, which ends every process left in the namespace.

A program that forges lines on STATUS_FD (it runs as the same uid) gains nothing: it can set
its own exit status anyway. Standard library only: under ``-I -S`` nothing else is on the path.
"""

import os
import resource
import sys


def _set_limits(spec):
    for item in spec.split(","):
        name, soft, hard = item.split(":")
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (int(soft), int(hard)))


def _hide_init_frames(kind, value, tb, _print=sys.__excepthook__):
    # Bound as a default: the program's run clears this module's names.
    while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
        tb = tb.tb_next  # the traceback starts in the program, as with `python program.py`
    _print(kind, value.with_traceback(tb), tb)  # it prints value.__traceback__, not tb


def _run_program(path):
    """Become `python -I -S path`: the program runs as __main__, with this module's names gone."""
    import builtins

    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    namespace = sys.modules["__main__"].__dict__
    namespace.clear()
    namespace.update(__name__="__main__", __file__=path, __builtins__=builtins, __doc__=None,
                     __loader__=None, __spec__=None, __package__=None, __cached__=None)
    exec(code, namespace)


def _main():
    status_fd, limits, program = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.write(status_fd, b"started\n")
    pid = os.fork()
    if pid == 0:
        os.closerange(3, 1 << 16)  # the program keeps stdin, stdout and stderr only
        os.environ.pop("PWD", None)  # bubblewrap's; the environment is only what run_python set
        _set_limits(limits)
        sys.argv = [program]
        sys.excepthook = _hide_init_frames
        return _run_program(program)
    while True:  # as PID 1, every orphan of the run is ours to reap
        done, wait_status = os.wait()
        if done == pid:
            os.write(status_fd, b"%d\n" % wait_status)
            os._exit(0)


if __name__ == "__main__":
    _main()
