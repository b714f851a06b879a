"""The foundations the other features build on: the layered import graph, the compressor interface, the
layers' own windows in the probes, and a repository that stands alone (its documents live in docs/, every
reference to them resolves, and the tests mirror the package)."""

import ast
import re
import subprocess
from pathlib import Path

import pytest
import torch

from phasekv import ModelConfig, build_model
from phasekv.compression import compressors_of
from phasekv.probes.gates import gate_statistics
from tests.helpers import tiny

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "phasekv"
TESTS = REPO / "tests"


# ----------------------------------------------------------------------------- the import graph


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (type-only imports are no dependency)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                continue
            stack.append(child)


def import_graph() -> dict[str, set[str]]:
    """module -> phasekv modules it imports anywhere in its source (top level or inside functions)."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("phasekv"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("phasekv"):
                for alias in node.names:  # `from phasekv.x import y`: y may itself be a module
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = {t for t in targets if t != name}
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, stack = set(), list(graph.get(start, ()))
    while stack:
        node = stack.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(graph.get(node, ()))
    return False


def test_import_graph_has_no_cycle():
    graph = import_graph()
    cycles = sorted(m for m in graph if _reaches(graph, m, m))
    assert not cycles, f"modules on an import cycle: {cycles}"


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# what is measured sits above how a model is reached; the commands sit on top
_MEASURED = ["phasekv.data", "phasekv.evaluate", "phasekv.probes", "phasekv.report", "phasekv.auditing", "phasekv.cli",
             "phasekv.training", "phasekv.export"]


@pytest.mark.parametrize("lower, forbidden", [
    ("phasekv.config", ["phasekv"]),  # the bottom layer imports nothing of phasekv but itself
    ("phasekv.layers", ["phasekv"]),
    ("phasekv.memory", ["phasekv.config", "phasekv.model", "phasekv.families", "phasekv.adapters", "phasekv.evaluate",
                        "phasekv.training", "phasekv.cli"]),  # one check below every estimate that uses it
    ("phasekv.figures", ["phasekv.config", "phasekv.model", "phasekv.evaluate", "phasekv.probes", "phasekv.theory"]),
    ("phasekv.kernels", ["phasekv.attention", "phasekv.cache", "phasekv.model"]),  # kernels know no layer or cache
    ("phasekv.compression", ["phasekv.attention", "phasekv.model", "phasekv.training", "phasekv.evaluate",
                             "phasekv.families", "phasekv.checkpoint"]),
    ("phasekv.hf", ["phasekv.families", "phasekv.adapters", "phasekv.engines", "phasekv.conditions", *_MEASURED]),
    ("phasekv.archs", ["phasekv.families", "phasekv.adapters", "phasekv.engines", "phasekv.conditions", *_MEASURED]),
    ("phasekv.families", ["phasekv.adapters", "phasekv.engines", "phasekv.conditions", *_MEASURED]),
    ("phasekv.adapters", ["phasekv.engines", "phasekv.conditions", *_MEASURED]),  # how phasekv reaches a model
    ("phasekv.engines", ["phasekv.conditions", *_MEASURED]),  # a served model: below what is measured
    ("phasekv.conditions", ["phasekv.engines", *_MEASURED]),  # what an audit does to an in-process model
    ("phasekv.evaluate", ["phasekv.training", "phasekv.report", "phasekv.auditing", "phasekv.cli", "phasekv.probes",
                          "phasekv.export", "phasekv.conditions"]),
    ("phasekv.export", ["phasekv.training", "phasekv.report", "phasekv.auditing", "phasekv.cli", "phasekv.probes"]),
    ("phasekv.probes", ["phasekv.training", "phasekv.report", "phasekv.auditing", "phasekv.cli"]),
    ("phasekv.report", ["phasekv.auditing", "phasekv.cli"]),
    ("phasekv.auditing", ["phasekv.cli", "phasekv.training"]),
    ("phasekv.training", ["phasekv.evaluate", "phasekv.probes", "phasekv.report", "phasekv.auditing", "phasekv.cli"]),
    ("phasekv.training.rundir", ["phasekv.training.loop", "phasekv.training.distill_indexer", "phasekv.data",
                                 "phasekv.evaluate", "phasekv.probes", "phasekv.report", "phasekv.cli"]),  # the run
    # directory knows nothing of the loop that fills it
])
def test_no_lower_layer_imports_a_higher_one(lower, forbidden):
    graph = import_graph()
    for module, targets in graph.items():
        if not _in(module, lower):
            continue
        for target in targets:
            if _in(target, lower):
                continue  # within its own package
            assert not any(_in(target, f) for f in forbidden), f"{module} imports {target}"


def test_only_cli_modules_define_argument_parsers():
    for path in SRC.rglob("*.py"):
        if _module_name(path).startswith("phasekv.cli"):
            continue
        source = path.read_text()
        assert "argparse" not in source and "add_parser" not in source, path


def test_no_parameter_name_matching_outside_the_compressors():
    """Roles of compressor parameters come from the compressor interface, never from name strings."""
    for path in SRC.rglob("*.py"):
        if _module_name(path).startswith("phasekv.compression"):
            continue
        source = path.read_text()
        # archs/indexer_kl.py sets transformers' own indexers' `index_topk` (their attribute, found by class, for the
        # dense warm-up) and export/gguf*.py read it into llama.cpp's hyper-parameters: not a phasekv compressor
        # option; conditions/selection/scorers.py builds a Glm5NextTextIndexer's config, which names it
        name = _module_name(path)
        exempt = (name in ("phasekv.archs.indexer_kl", "phasekv.conditions.selection.scorers")
                  or name.startswith("phasekv.export.gguf"))
        topk = () if exempt else ("index_topk",)
        for pattern in ('".compressor."', "'_gate'", '"_gate"', '"_gate_bias"', 'getattr(self.compressor', *topk):
            assert pattern not in source, f"{path} contains {pattern}"


# files over MAX_FILE_LINES that are being split elsewhere (each with the reason); nothing else may grow past it
MAX_FILE_LINES = 450
LONG_FILES: dict[str, str] = {}
MAX_FOLDER_SHARE = 0.12  # no folder holds more than this share of the package's lines
MAX_ROOT_MODULES = 12
MAX_POSITIONAL = 6
# functions that still take more than MAX_POSITIONAL positional parameters, to be made keyword-only (issue 36); the
# list may only shrink
MANY_POSITIONAL = {
}


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_folder_holds_more_than_12_percent_of_the_package():
    total = sum(_lines(p) for p in SRC.rglob("*.py"))
    shares = {str(d.relative_to(SRC)): sum(_lines(p) for p in d.rglob("*.py")) / total
              for d in SRC.iterdir() if d.is_dir() and d.name != "__pycache__"}
    crowded = {name: round(share, 3) for name, share in shares.items() if share > MAX_FOLDER_SHARE}
    assert not crowded, f"folders over {MAX_FOLDER_SHARE:.0%} of the package: {crowded}"


def test_the_package_root_holds_at_most_12_modules():
    root = sorted(p.name for p in SRC.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {root}"


def test_no_re_export_shim_and_no_private_name_imported_across_modules():
    """A name is imported from the module that defines it: an import kept only to be re-exported (`noqa: F401`) is
    a shim, except the registries' imports of their members (`registration`); a leading underscore is private to
    its module."""
    found = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for number, line in enumerate(text.splitlines(), 1):
            if "noqa: F401" in line and "registration" not in line:
                found.append(f"{path.relative_to(SRC)}:{number} re-exports")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("phasekv"):
                found += [f"{path.relative_to(SRC)}:{node.lineno} imports {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_")]
    assert not found, found


def test_architecture_doc_names_every_module():
    """docs/architecture.md's package table has one row per root module or folder; a folder's row names each of
    its modules (`selection/kernel.py` or `kernel.py`)."""
    rows: dict[str, str] = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        if line.startswith("| `"):
            head, _, rest = line[2:].partition("|")
            for name in re.findall(r"`([^`]+)`", head):
                rows[name] = rest
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC)
        if len(relative.parts) == 1:
            if path.name not in rows and path.name != "__main__.py":
                missing.append(str(relative))
            continue
        row = rows.get(f"{relative.parts[0]}/")
        inner = "/".join(relative.parts[1:])
        if path.name == "__init__.py" and len(relative.parts) == 2:
            named = row is not None
        else:
            named = row is not None and (f"`{inner}`" in row or f"`{path.name}`" in row
                                         or (path.name == "__init__.py" and f"`{relative.parts[-2]}/`" in row))
        if not named:
            missing.append(str(relative))
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_no_file_is_over_450_lines():
    lines = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    long = {name: n for name, n in lines.items() if n > MAX_FILE_LINES}
    assert set(long) <= set(LONG_FILES), f"files over {MAX_FILE_LINES} lines: {long}"


def _functions():
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node


def _positional(node) -> list[str]:
    names = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def test_no_function_takes_more_than_6_positional_parameters():
    """Calls with many positional arguments are read wrong: past six, parameters are keyword-only."""
    found = [f"{path.relative_to(SRC)}:{node.lineno} {node.name}" for path, node in _functions()
             if len(_positional(node)) > MAX_POSITIONAL
             and node.name not in MANY_POSITIONAL.get(str(path.relative_to(SRC)), ())]
    assert not found, f"functions with more than {MAX_POSITIONAL} positional parameters: {found}"
    many = {(str(path.relative_to(SRC)), node.name) for path, node in _functions()
            if len(_positional(node)) > MAX_POSITIONAL}
    fixed = sorted((f, n) for f, names in MANY_POSITIONAL.items() for n in names if (f, n) not in many)
    assert not fixed, f"MANY_POSITIONAL lists functions that no longer take more than {MAX_POSITIONAL}: {fixed}"


# records still built with more than MAX_POSITIONAL positional fields (file: constructor names); may only shrink
MANY_POSITIONAL_FIELDS: dict[str, set[str]] = {}


def _record_calls_by_position(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls of a class (a capitalized name) with more than MAX_POSITIONAL positional arguments."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name[:1].isupper() and sum(not isinstance(a, ast.Starred) for a in node.args) > MAX_POSITIONAL:
                found.append((node.lineno, name))
    return found


def test_records_with_many_fields_are_built_by_keyword():
    """`ModelInfo(name, 9, 2, 4, 4, 16, ...)` is read wrong as easily as a call of a function with many parameters."""
    found = {str(path.relative_to(SRC)): {name for _, name in _record_calls_by_position(ast.parse(path.read_text()))}
             for path in SRC.rglob("*.py")}
    found = {f: names for f, names in found.items() if names}
    extra = {f: names - MANY_POSITIONAL_FIELDS.get(f, set()) for f, names in found.items()}
    assert not any(extra.values()), f"records built with more than {MAX_POSITIONAL} positional fields: {extra}"
    stale = {f: names - found.get(f, set()) for f, names in MANY_POSITIONAL_FIELDS.items()}
    assert not any(stale.values()), f"MANY_POSITIONAL_FIELDS lists calls that now use keywords: {stale}"
    assert _record_calls_by_position(ast.parse("ModelInfo('m', 1, 2, 3, 4, 5, 6, None, None)")) == [(1, "ModelInfo")]
    assert not _record_calls_by_position(ast.parse("check(args, 'a', 'b', 'c', 'd', 'e', 'f', 'g')"))
    assert not _record_calls_by_position(ast.parse("ModelInfo('m', 1, 2, *rest)"))


# JSON files still written by hand outside phasekv.outputs (each with the reason); the list may only shrink
JSON_WRITERS_LEFT: dict[str, str] = {}
FILE_WRITES = {"write", "writelines", "write_text", "write_bytes", "write_atomic"}


def _writes_json(node: ast.AST) -> bool:
    """A json.dump call, or a file write whose argument holds a json.dumps call."""
    if not isinstance(node, ast.Call):
        return False
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    if name == "dump" and getattr(getattr(node.func, "value", None), "id", "") == "json":
        return True
    return name in FILE_WRITES and any(isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "dumps"
                                       for a in node.args for n in ast.walk(a))


def test_json_files_are_written_only_by_the_outputs_module():
    """`outputs.write_json`, `write_jsonl` and `append_jsonl` keep each file's layout in one place."""
    found = sorted({str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if path.name != "outputs.py"
                    for node in ast.walk(ast.parse(path.read_text())) if _writes_json(node)})
    assert found == sorted(JSON_WRITERS_LEFT), f"JSON written outside phasekv.outputs: {found}"
    assert _writes_json(ast.parse('f.write(json.dumps(row) + "\\n")').body[0].value)  # the rule says no
    assert _writes_json(ast.parse("json.dump(tree, f)").body[0].value)
    assert not _writes_json(ast.parse("json.loads(json.dumps(tree))").body[0].value)


def test_functions_are_short_or_say_why():
    """No function longer than 60 lines without a `# long: reason` comment on its first line."""
    for path in SRC.rglob("*.py"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            length = node.end_lineno - node.lineno + 1 if isinstance(node, ast.FunctionDef) else 0
            if length > 60:
                header = " ".join(lines[node.lineno - 1:node.body[0].lineno])
                assert "# long:" in header, f"{path}:{node.lineno} {node.name} has {length} lines"


# ----------------------------------------------------------------------------- compressor interface


def test_a_compressor_from_outside_the_package_brings_its_own_options():
    """tests/toy_compressor.py registers `toy_mean` with a knob (`scale`) config/model.py has never heard of."""
    assert "scale" not in (SRC / "config" / "model.py").read_text().split("class TransformersModelConfig")[0].split(
        "class ModelConfig")[1]
    config = tiny(compressor="toy_mean", span=4, scale=2.0)
    assert config.options("toy_mean").scale == 2.0 and config.phase_stride == 4
    with pytest.raises(ValueError, match="toy_mean.scale"):
        tiny(compressor="toy_mean", scale=-1.0)
    with pytest.raises(ValueError, match="toy_mean.span"):
        tiny(compressor="toy_mean", span="three")
    assert ModelConfig.from_dict(config.to_dict()) == config  # round trip through plain data


def test_staggered_layers_report_gates_on_their_real_windows():
    """Layer 1 of a staggered W = S = 4 model starts its windows at position 2.  A token X placed at every
    position = 3 mod 4 sits at offset 1 of layer 1's windows (and offset 3 of layer 0's); a gate that
    attends to X must show that, which it does only if statistics use the layer's true window starts."""
    config = tiny(compressor="gated", window=4, stride=4, stagger=True, num_key_value_heads=1)
    model = _gates_see_token(config, X=5)
    assert [c.offset for _, c in compressors_of(model)] == [0, 2]
    ids = torch.randint(6, config.vocab_size, (3, 42))
    ids[:, 3::4] = 5
    gates = {(g["layer"], g["branch"]): g for g in gate_statistics(model, ids, progress=False)}
    assert gates[(0, "k")]["profile"] == pytest.approx([0, 0, 0, 1], abs=1e-4)
    assert gates[(1, "k")]["profile"] == pytest.approx([0, 1, 0, 0], abs=1e-4)
    assert gates[(1, "k")]["first_window_start"] == 2
    assert gates[(1, "k")]["offset_phases"] == [2, 3, 0, 1]  # the profile's peak is at phase 3 in both layers


def test_staggered_heads_report_gates_on_their_own_windows():
    """With head stagger (W = S = 4, 2 KV heads), head 1 starts its windows at 2: X at every position = 3 mod 4
    sits at offset 3 of head 0's windows and offset 1 of head 1's, in each layer."""
    config = tiny(compressor="gated", window=4, stride=4, head_stagger=True)
    model = _gates_see_token(config, X=5)
    ids = torch.randint(6, config.vocab_size, (3, 42))
    ids[:, 3::4] = 5
    gates = {(g["layer"], g["kv_head"]): g for g in gate_statistics(model, ids, progress=False) if g["branch"] == "k"}
    for layer in (0, 1):
        assert gates[(layer, 0)]["profile"] == pytest.approx([0, 0, 0, 1], abs=1e-4)
        assert gates[(layer, 1)]["profile"] == pytest.approx([0, 1, 0, 0], abs=1e-4)
        assert gates[(layer, 1)]["first_window_start"] == 2
        assert gates[(layer, 1)]["offset_phases"] == [2, 3, 0, 1]


def _gates_see_token(config, X: int):
    """A model whose residual stream is the token embedding and whose key gates attend only to token X."""
    torch.manual_seed(0)
    model = build_model(config).eval()
    layers = compressors_of(model)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream stays the token embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 0.0
        emb[X] = 0.0
        emb[X, 0] = 1.0  # only X has a component on hidden dim 0
        for _, c in layers:
            for name, p in c.gate_parameters().items():
                p.zero_()
                if name == "k_gate":
                    p[:, 0, :] = 50.0  # every offset's logit = 50 * (normalized h)[0]: large only for X
    return model


def test_cycling_excludes_each_layers_boundary_phase():
    from phasekv.probes.cycle import boundary_phases, cycle_stride

    assert boundary_phases(build_model(tiny(compressor="gated", window=4, stride=4))) == [3]
    assert boundary_phases(build_model(tiny(compressor="gated", window=4, stride=4, stagger=True))) == [1, 3]
    with pytest.raises(ValueError, match="staggers its KV heads"):
        cycle_stride(build_model(tiny(compressor="gated", window=4, stride=4, head_stagger=True)))


# ----------------------------------------------------------------------------- a repository that stands alone

# Documents that exist only outside the repository: nothing in it may point there.  The names are built from
# parts so that this file does not mention them itself.
OUTSIDE_DOCUMENTS = (*(f"{name}.md" for name in ("PAPER", "DESIGN", "STYLE", "FINDINGS")),
                     "/".join(("..", "shared")), "/".join(("", "work", "shared")))
DOC_MENTION = re.compile(r"\bdocs/([\w.-]+?\.md)\b")
# "docs/science.md section 4", "sections 3 and 6", "s. 3", "docs/science.md's section 1"
SCIENCE_CITATION = re.compile(r"docs/science\.md(?:'s)?\s+(?:sections?|s\.)\s+(\d+(?:(?:\s*,\s*|\s+and\s+)\d+)*)")
STYLE_CITATION = re.compile(r"docs/style\.md\s+(?:rule\s+)?(\d+)")


def repository_files() -> dict[str, str]:
    """path -> text of every file a commit would hold (tracked, and new files git does not ignore); binary files
    are left out."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the repository's files cannot be listed")
    files = {}
    for name in sorted(set(listed.split("\0")) - {""}):
        path = REPO / name
        if path.is_symlink() or not path.is_file():  # e.g. deleted in the work tree, not yet in the index
            continue
        with open(path, "rb") as f:
            if b"\0" in f.read(8192):
                continue
        try:
            files[name] = path.read_text()
        except UnicodeDecodeError:
            continue
    return files


def _mentions(pattern: re.Pattern, files: dict[str, str]) -> list[tuple[str, int, re.Match]]:
    """(path, line, match) of every match of `pattern` in `files`."""
    return [(name, text.count("\n", 0, m.start()) + 1, m) for name, text in files.items()
            for m in pattern.finditer(text)]


def test_no_file_refers_to_a_document_outside_the_repository():
    files = repository_files()
    assert "README.md" in files and "src/phasekv/config/model.py" in files  # the listing found the repository
    found = [f"{name}:{text.count(chr(10), 0, text.index(doc)) + 1}: {doc}" for name, text in files.items()
             for doc in OUTSIDE_DOCUMENTS if doc in text]
    assert not found, f"references to documents outside the repository: {found}"


def test_every_document_mentioned_exists_in_docs():
    mentions = _mentions(DOC_MENTION, repository_files())
    assert {m.group(1) for _, _, m in mentions} >= {"science.md", "architecture.md", "style.md"}
    missing = [f"{name}:{line}: docs/{m.group(1)}" for name, line, m in mentions
               if not (REPO / "docs" / m.group(1)).is_file()]
    assert not missing, f"documents mentioned but absent from docs/: {missing}"


def test_every_cited_section_and_rule_exists():
    files = repository_files()
    science, style = (REPO / "docs" / "science.md").read_text(), (REPO / "docs" / "style.md").read_text()
    sections = [int(n) for n in re.findall(r"^## (\d+)\. ", science, re.M)]
    assert sections == list(range(1, 8)), f"docs/science.md numbers its sections 1..7, found {sections}"
    rules = [int(n) for n in re.findall(r"^(\d+)\. \*\*", style, re.M)]
    assert rules == list(range(1, len(rules) + 1)) and len(rules) >= 6
    cited = [(name, line, int(n), sections) for name, line, m in _mentions(SCIENCE_CITATION, files)
             for n in re.findall(r"\d+", m.group(1))]
    cited += [(name, line, int(m.group(1)), rules) for name, line, m in _mentions(STYLE_CITATION, files)]
    assert len(cited) >= 30  # the docstrings cite their sections
    absent = [f"{name}:{line}: {n}" for name, line, n, present in cited if n not in present]
    assert not absent, f"citations of sections or rules that docs/science.md or docs/style.md does not have: {absent}"


# where a module's tests live when they are not in tests/test_<module>.py
TESTED_IN = {
    "__main__": "test_foundations.py",  # `python -m phasekv` and `python -m phasekv.cli`, both entry points
    "layers": "test_model.py",  # RMSNorm and RoPE against their references, with the model
    "kernels": "test_attention.py",  # each kernel against its oracle, `windowed_attention_reference`
    "hf": "test_hf_model.py",  # phasekv checkpoints through transformers' Auto classes; TextCausalLM in test_realarch
    "cli": "test_fuzz.py",  # every subcommand's bad input; kills in test_reliability.py; each command's own test
    "report": "test_reproduce.py",  # with test_findings.py and test_report_browser.py
    "adapters": "test_multiquery.py",  # with test_hf_model.py and test_evaluate.py
    "conditions": "test_posthoc.py",  # with test_presses.py, test_selection*.py, test_head_slices.py, test_hybrid.py
    "engines": "test_endpoint.py",  # with test_endpoint_faults.py, test_engine_grid.py, test_vllm*.py, test_sglang.py
    "export": "test_lmeval.py",  # with test_export_gguf*.py
    "auditing": "test_audit.py",  # with test_engine_grid.py, test_expect.py, test_endpoint_fleet.py
    "training": "test_train.py",  # checkpoints, resume and final/; kills in test_reliability.py; the distilled
    # indexer in test_selection.py, the indexers' KL objective in test_indexer.py
}


def test_tests_mirror_the_package():
    units = sorted(p.stem for p in SRC.iterdir() if p.suffix == ".py" and p.stem != "__init__")
    units += sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())
    assert {"config", "checkpoint", "outputs", "families", "training", "evaluate", "auditing", "cli"} <= set(units)
    for unit in units:
        own = TESTS / f"test_{unit}.py"
        if unit in TESTED_IN:
            assert not own.exists(), f"{unit}: tests/test_{unit}.py exists, drop its TESTED_IN entry"
            assert TESTED_IN[unit] is None or (TESTS / TESTED_IN[unit]).is_file(), unit
        else:
            assert own.is_file(), f"src/phasekv/{unit}: no tests/test_{unit}.py (or say where its tests are: TESTED_IN)"
    assert set(TESTED_IN) <= set(units), f"TESTED_IN names modules that do not exist: {set(TESTED_IN) - set(units)}"


# ----------------------------------------------------------------------------- one home per architecture

# the classes, modules and attributes of transformers' DeepSeek and GLM architectures: only their files in
# src/phasekv/archs/ name them (the generic modules ask `phasekv.archs.architecture_of(model)`)
ARCHITECTURE_NAMES = ("DeepseekV", "deepseek_v", "Glm5", "glm5", "o_a_proj", "compress_rate", "index_kpool",
                      "position_bias", "compressed_sparse_attention", "heavily_compressed_attention",
                      "indexed_attention", "v4gates", "v4_")


def test_families_probes_and_report_name_no_architecture():
    generic = [SRC / "families.py", *sorted((SRC / "probes").glob("*.py")), *sorted((SRC / "report").glob("*.py"))]
    found = [f"{path.relative_to(SRC)}:{n}: {name}" for path in generic
             for n, line in enumerate(path.read_text().splitlines(), 1) for name in ARCHITECTURE_NAMES if name in line]
    assert not found, f"architecture names outside src/phasekv/archs/: {found}"
    assert all(any(name in p.read_text() for p in (SRC / "archs").glob("*.py")) for name in ARCHITECTURE_NAMES[:8])


@pytest.mark.parametrize("module", ["phasekv", "phasekv.cli"])
def test_python_dash_m_runs_the_command(module):
    """`python -m phasekv` and `python -m phasekv.cli` are the `phasekv` command: its help, and its exit 2 on a bad
    subcommand."""
    import sys

    ok = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "audit" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", module, "no-such-command"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2, bad.stderr


def test_readme_is_short():
    """The README is a newcomer's ten minutes: details live in docs/."""
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines < 300, f"README.md has {lines} lines; move details to docs/"
