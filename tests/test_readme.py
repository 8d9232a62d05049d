"""README.md's examples, run as written.

Every ```python block is run as a script of its own (a fresh interpreter, with tracebacks pointing at README.md's
lines). On a GPU each must succeed: the examples check their results with their own asserts. Without a GPU, each
one that needs no framework must stop at the library's clean `NoDeviceError` (one line naming the cause, no
chained traceback); the ones that need torch / cupy / jax are skipped with the reason (not installed, or no GPU
for it), and a block whose first line is `# needs no GPU` must succeed anywhere. The ```bash blocks are not run:
their `cudart-kernels` commands are checked against the CLI, and the install and test commands against `.ci/run`.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import shlex
import site
import subprocess
import sys
from dataclasses import dataclass

import pytest

import cudart_kernels
from conftest import HAS_GPU

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FRAMEWORKS = ("torch", "cupy", "jax")
NO_GPU_MARK = "# needs no GPU"
SHELL_COMMANDS = ("python -m pip install", "python -m pytest", "cudart-kernels", "bash scripts/")


@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # README line of the block's first source line
    source: str

    @property
    def id(self) -> str:
        return f"README.md:{self.line}-{self.kind}"

    def imports(self) -> set:
        """Every module the example imports, by its full name (`from a import b` counts as a and a.b)."""
        names = set()
        for node in ast.walk(ast.parse(self.source)):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        return names

    @property
    def frameworks(self) -> tuple:
        """The frameworks the example needs (cudart_kernels.torch and .deep_gemm need torch)."""
        if self.lang != "python":
            return ()
        found = {name.split(".")[0] for name in self.imports()}
        if any(name.startswith(("cudart_kernels.torch", "cudart_kernels.deep_gemm")) for name in self.imports()):
            found.add("torch")
        return tuple(f for f in FRAMEWORKS if f in found)

    @property
    def kind(self) -> str:
        """'shell', 'cpu' (needs no GPU), 'numpy' (the library alone) or the frameworks it needs; '?' otherwise."""
        if self.lang == "bash":
            commands = shell_commands(self)
            return "shell" if commands and all(c.startswith(SHELL_COMMANDS) for c in commands) else "?"
        if self.lang != "python":
            return "?"
        try:
            imports = self.imports()
        except SyntaxError:
            return "?"
        if "cudart_kernels" not in {name.split(".")[0] for name in imports}:
            return "?"
        if self.source.startswith(NO_GPU_MARK):
            return "cpu"
        return "+".join(self.frameworks) or "numpy"


def readme_blocks(text: str) -> list:
    """The fenced blocks of `text`, in order; ValueError on a fence left open."""
    blocks, lang, start, body = [], None, 0, []
    for i, line in enumerate(text.split("\n"), 1):
        fence = line.strip().startswith("```")
        if lang is None and fence:
            lang, start, body = line.strip()[3:].strip(), i + 1, []
        elif lang is not None and line.strip() == "```":
            blocks.append(Block(lang, start, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            if fence:
                raise ValueError(f"README.md:{i}: a fence opens inside the block that starts at line {start - 1}")
            body.append(line)
    if lang is not None:
        raise ValueError(f"README.md:{start - 1}: the ```{lang} block is never closed")
    return blocks


def shell_commands(block: Block) -> list:
    """A shell block's commands, comments and continuation comments dropped."""
    return [c for c in (line.split("#", 1)[0].strip() for line in block.source.split("\n")) if c]


BLOCKS = readme_blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SHELL = [b for b in BLOCKS if b.lang == "bash"]

# Runs one example (read from stdin) in a fresh interpreter; argv: README's path, the block's first line, the result
# file, the frameworks it needs. The line offset keeps tracebacks on README.md's own lines. The result file gets
# {"status": "ok" | "skip" (a framework unusable here) | "error", ...} as JSON.
RUNNER = r"""
import importlib, json, sys, traceback

path, line, result_file, frameworks = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
source = sys.stdin.read()


def write(**result):
    with open(result_file, "w") as f:
        json.dump(result, f)


def unusable(name):
    try:
        mod = importlib.import_module(name)
    except ImportError as e:
        return f"{name} is not installed ({e})"
    try:
        if name == "torch" and not mod.cuda.is_available():
            return "torch is installed but has no CUDA device"
        if name == "cupy" and mod.cuda.runtime.getDeviceCount() == 0:
            return "cupy is installed but sees no CUDA device"
        if name == "jax" and not any(d.platform == "gpu" for d in mod.devices()):
            return "jax is installed but has no GPU backend"
    except Exception as e:
        return f"{name} is installed but cannot use a GPU ({type(e).__name__}: {e})"
    return None


for name in frameworks:
    reason = unusable(name)
    if reason:
        write(status="skip", reason=reason)
        sys.exit(0)
try:
    exec(compile("\n" * (line - 1) + source, path, "exec"), {"__name__": "__main__"})
except BaseException as e:
    write(status="error", type=f"{type(e).__module__}.{type(e).__qualname__}", message=str(e),
          chained=e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__),
          traceback=traceback.format_exc())
    sys.exit(1)
write(status="ok")
"""


def run_example(block: Block, tmp_path, timeout: int) -> dict:
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # jax would take 75% of the GPU's memory at its first array
    package_root = str(pathlib.Path(cudart_kernels.__file__).resolve().parent.parent)
    if package_root not in site.getsitepackages():  # a source tree (python -m pytest puts it first): the same there
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    result_file = tmp_path / "result.json"
    r = subprocess.run([sys.executable, "-c", RUNNER, str(README), str(block.line), str(result_file),
                        *block.frameworks], input=block.source, capture_output=True, text=True, timeout=timeout,
                       cwd=tmp_path, env=env)
    if not result_file.exists():
        pytest.fail(f"{block.id}: the example's interpreter died (exit {r.returncode})\n{r.stdout}\n{r.stderr}")
    result = json.loads(result_file.read_text())
    result["output"] = r.stdout + r.stderr
    return result


def skip_unless_installed(block: Block) -> None:
    missing = [f for f in block.frameworks if importlib.util.find_spec(f) is None]
    if missing:
        pytest.skip(f"{block.id} needs {' and '.join(missing)}, not installed here")


# ---- the blocks themselves ---------------------------------------------------------------------------------------

def test_blocks_are_found_and_recognised():
    assert PYTHON and SHELL, "no ```python or ```bash blocks found in README.md"
    unknown = [f"README.md:{b.line} ```{b.lang}" for b in BLOCKS if b.kind == "?"]
    assert not unknown, ("blocks of no known kind (python examples import cudart_kernels and parse; shell blocks "
                         f"hold {SHELL_COMMANDS} commands): {unknown}")
    kinds = {b.kind for b in PYTHON}
    assert {"numpy", "torch", "cupy", "jax"} <= kinds, f"README examples cover only {sorted(kinds)}"


def test_every_op_has_an_example():
    called = {node.func.attr for b in PYTHON for node in ast.walk(ast.parse(b.source))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    ops = [name for name in cudart_kernels.__all__ if callable(getattr(cudart_kernels, name))
           and getattr(cudart_kernels, name).__module__.startswith("cudart_kernels.ops.")]
    assert len(ops) >= 9 and not set(ops) - called, f"ops without a README example: {sorted(set(ops) - called)}"


def test_fence_errors_are_caught():
    with pytest.raises(ValueError, match="never closed"):
        readme_blocks("text\n```python\nimport cudart_kernels\n")
    with pytest.raises(ValueError, match="opens inside"):
        readme_blocks("```python\nimport cudart_kernels\n```bash\n```\n")
    (block,) = readme_blocks("a\n\n```python\nfrom cudart_kernels import deep_gemm\n```\n")
    assert (block.line, block.kind, block.frameworks) == (4, "torch", ("torch",))
    (block,) = readme_blocks("```python\nimport jax.numpy as jnp, cudart_kernels as ck\nck.gemm(\n```\n")
    assert block.kind == "?"  # a syntax error


# ---- the python examples -----------------------------------------------------------------------------------------

def _run_or_skip(block, tmp_path, timeout: int, why: str) -> dict:
    """Run an example, skipping the test where its framework is missing (`why` is added to the reason)."""
    skip_unless_installed(block)
    result = run_example(block, tmp_path, timeout=timeout)
    if result["status"] == "skip":
        pytest.skip(f"{block.id}: {result['reason']}{why}")
    return result


@pytest.mark.gpu
@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_example_runs_on_the_gpu(block, tmp_path):
    result = _run_or_skip(block, tmp_path, 600, "")
    assert result["status"] == "ok", f"{block.id} failed:\n{result.get('traceback', '')}\n{result['output']}"


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: test_example_runs_on_the_gpu runs the examples")
@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_example_without_gpu_fails_cleanly(block, tmp_path):
    result = _run_or_skip(block, tmp_path, 300, " (the example needs it on a GPU)")
    if block.kind == "cpu":
        assert result["status"] == "ok", f"{block.id} needs no GPU but failed:\n{result['traceback']}"
        return
    assert result["status"] == "error", f"{block.id} ran to the end without a GPU"
    assert result["type"] == "cudart_kernels.runtime.driver.NoDeviceError", (
        f"{block.id} should stop at NoDeviceError, got:\n{result['traceback']}")
    msg = result["message"]
    assert "\n" not in msg and msg.startswith("cudart-kernels needs an sm_90a (Hopper) GPU: "), msg
    assert not result["chained"], f"NoDeviceError chained to another exception:\n{result['traceback']}"


# ---- the shell blocks --------------------------------------------------------------------------------------------

def _cli(capsys, *argv) -> tuple[int, str]:
    from cudart_kernels import cli

    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().out


def test_cli_commands_exist(capsys):
    """Each `cudart-kernels ...` line names a real subcommand (and real --op choices); --version and info run."""
    lines = [shlex.split(c.replace("[", " ").replace("]", " "))
             for b in SHELL for c in shell_commands(b) if c.startswith("cudart-kernels")]
    assert lines
    for words in lines:
        sub = words[1]
        if sub == "--version":
            rc, out = _cli(capsys, "--version")
            assert rc == 0 and out.strip() == f"cudart-kernels {cudart_kernels.__version__}"
            continue
        assert _cli(capsys, sub, "--help")[0] == 0, f"cudart-kernels {sub}: no such command"
        for i, w in enumerate(words):
            if w == "--op":
                for op in words[i + 1].split("|"):
                    assert _cli(capsys, sub, "--op", op, "--help")[0] == 0, f"cudart-kernels {sub} --op {op}"
    rc, out = _cli(capsys, "info")
    assert rc == 0 and out.startswith(f"cudart-kernels {cudart_kernels.__version__}")


def test_ci_runs_the_readme_install_and_test_commands():
    """The first shell block (Install and test) is what .ci/run does, give or take pip's and pytest's -q."""

    def norm(cmd):
        try:
            words = shlex.split(cmd)
        except ValueError:  # a quote left open on this line (a multi-line string)
            words = cmd.split()
        return [w for w in words if w != "-q"]

    ci = [norm(line) for line in (ROOT / ".ci" / "run").read_text().split("\n")
          if line.strip() and not line.lstrip().startswith("#")]
    readme = [norm(c) for c in shell_commands(SHELL[0])]
    assert readme and any(c[:2] == ["python", "-m"] and "pytest" in c for c in readme)
    for cmd in readme:
        assert cmd in ci, f"README's `{shlex.join(cmd)}` is not run by .ci/run"
