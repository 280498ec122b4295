"""planted.py — run a compiler over planted snippets: each must be rejected
with a diagnostic holding an expected word, and a control must compile (so a
broken command line cannot pass for strictness). Shared by shim_strict.py
and msl_check.py."""
import os
import subprocess
import tempfile


def compile_file(cmd, path, post=None):
    """(ok, stderr) of `cmd + [path]`; then, if it compiled and post is given,
    post(path) -> a diagnostic (str) for what the compiler let through, or ""."""
    r = subprocess.run(cmd + [path], capture_output=True, text=True)
    if r.returncode == 0 and post is not None:
        diag = post(path)
        if diag:
            return False, diag
    return r.returncode == 0, r.stderr


def compile_src(cmd, src, suffix=".cpp", post=None):
    """(ok, stderr) of `cmd + [file]` on src written to a temporary file."""
    with tempfile.NamedTemporaryFile("w", suffix=suffix, delete=False) as f:
        f.write(src)
    try:
        return compile_file(cmd, f.name, post)
    finally:
        os.unlink(f.name)


def run_planted(label, cmd, control, bad, suffix=".cpp", post=None):
    """bad: [(name, snippet, word)]. Returns the number of failures."""
    ok, err = compile_src(cmd, control, suffix, post)
    print("%s: control %s" % (label, "compiles" if ok else "DOES NOT COMPILE"))
    if not ok:
        print(err[-3000:])
        return 1
    failed = 0
    for name, src, word in bad:
        ok, err = compile_src(cmd, src, suffix, post)
        caught = not ok and word in err
        print("%s: %-36s %s" % (label, name, "rejected" if caught else "NOT REJECTED" if ok else
                                "rejected without '%s' in the diagnostic" % word))
        if not caught:
            failed += 1
            if not ok:
                print(err[-1500:])
    print("%s: %d planted error(s), %d not caught" % (label, len(bad), failed))
    return failed
