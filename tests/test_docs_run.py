"""Every shell command and Python snippet of README.md, docs/*.md and the examples' READMEs runs as a
new user would run it (issue 18); the convention is in tests/docs_snippets.py.

Docs with a ``<!-- docs: slow -->`` block run under the ``slow`` marker; the rest in the quick subset.
"""

from __future__ import annotations

import pytest

from docs_snippets import REPO, Block, DocFailure, doc_files, parse_doc, run_doc

# Every block the tests do not run, (doc, its first line) -> the reason: a new skip must be added here on purpose.
SKIPPED = {
    ("README.md", "bash scripts/demo.sh     # installs into .venv, then runs `hybridflow demo` (whole pipeline on CPU)"):
        "installs a fresh .venv and runs the whole test suite (CI's .ci/run runs it)",
    ("docs/lora.md", "from peft import PeftModel"):
        "needs a finished LoRA run and its base model; tests/test_lora.py loads the exported adapter with PEFT this way",
    ("docs/agents.md", "python examples/agents/calculator_learns.py runs/calcsmol5 --model smollm2 --task product "
                       "--tool-share 0.3 \\"):
        "needs the converted SmolLM2 checkpoint and tens of minutes of this 2-core CPU; tests/test_agents_learns.py "
        "checks its rendering",
    ("docs/agents.md", "python examples/agents/calculator_learns.py runs/endpoint_probe --model smollm2 --task "
                       "product --tool-share 0.3 \\"):
        "needs the converted SmolLM2 checkpoint and tens of minutes of this 2-core CPU; tests/test_agents_learns.py "
        "checks its ids and its short form",
}


def _all_blocks() -> dict[str, list[Block]]:
    return {str(path.relative_to(REPO)): parse_doc(path) for path in doc_files()}


BLOCKS = _all_blocks()
RUN_DOCS = [doc for doc, blocks in BLOCKS.items() if any(block.runs for block in blocks)]


def _doc_param(doc: str):
    slow = any(block.slow and block.runs for block in BLOCKS[doc])
    return pytest.param(doc, id=doc, marks=[pytest.mark.slow] if slow else [])


def test_the_skipped_blocks_are_exactly_the_listed_ones_each_with_its_reason():
    skipped = {(block.doc, block.code.strip().splitlines()[0]): block.skip
               for blocks in BLOCKS.values() for block in blocks if block.skip}
    assert skipped == SKIPPED


@pytest.mark.parametrize("doc", [_doc_param(doc) for doc in RUN_DOCS])
def test_every_command_and_snippet_of_the_doc_runs(doc, tmp_path):
    try:
        run_doc(BLOCKS[doc], tmp_path)
    except DocFailure as failure:
        pytest.fail(str(failure), pytrace=False)


# --- the harness itself -------------------------------------------------------------------------

SAMPLE = '''# Sample

```bash
echo one > first.txt
```

<!-- docs: replace "steps=30" "steps=2" -->
<!-- docs: env SAMPLE_NAME=docs -->
```python
from pathlib import Path
count = int("steps=30".split("=")[1])
text = Path("first.txt").read_text().strip() + " " + __import__("os").environ["SAMPLE_NAME"]
```

<!-- docs: given
offset = 40
-->
```python
assert (count, text) == (2, "one docs"), (count, text)
total = count + offset
```

<!-- docs: output -->
```bash
this is what a command printed
```

```bash
test "$(cat first.txt)" = one
false && echo never
```
'''


def test_the_harness_runs_blocks_in_order_with_replacements_env_and_given_and_names_the_failing_command(tmp_path):
    doc = tmp_path / "sample.md"
    doc.write_text(SAMPLE)
    blocks = parse_doc(doc, root=tmp_path)
    assert [(block.line, block.language, block.runs) for block in blocks] == [
        (3, "bash", True), (9, "python", True), (18, "python", True), (24, "bash", False), (28, "bash", True)]
    assert blocks[1].replaces == [("steps=30", "steps=2")] and blocks[1].env == {"SAMPLE_NAME": "docs"}
    assert blocks[2].given == "offset = 40"
    workdir = tmp_path / "work"
    workdir.mkdir()
    with pytest.raises(DocFailure, match=r"^sample\.md:30: `false && echo never` exited with 1"):
        run_doc(blocks, workdir)
    assert (workdir / "first.txt").read_text() == "one\n" and (workdir / "examples").is_symlink()


def test_a_failing_python_block_is_reported_with_the_doc_line_of_the_error(tmp_path):
    doc = tmp_path / "broken.md"
    doc.write_text("```python\nx = 1\ny = undefined_name\n```\n")
    workdir = tmp_path / "work"
    workdir.mkdir()
    with pytest.raises(DocFailure) as caught:
        run_doc(parse_doc(doc, root=tmp_path), workdir)
    message = str(caught.value)
    assert message.startswith("broken.md:1: the ```python block failed:")
    assert 'File "broken.md", line 3' in message and "NameError: name 'undefined_name'" in message


@pytest.mark.parametrize(("text", "error"), [
    ('<!-- docs: skip -->\n```bash\nls\n```\n', r"x\.md:1: marker docs: skip takes 1 quoted argument"),
    ('<!-- docs: skip "" -->\n```bash\nls\n```\n', r"x\.md:1: docs: skip needs a reason"),
    ('<!-- docs: replace "nope" "2" -->\n```bash\nls\n```\n', r"x\.md:2: docs: replace 'nope' matches nothing"),
    ('<!-- docs: later -->\n```bash\nls\n```\n', r"x\.md:1: unknown marker docs: later; allowed: skip, output"),
    ('<!-- docs: slow -->\n\nsome prose\n```bash\nls\n```\n', r"x\.md:3: docs markers must stand right above"),
    ('<!-- docs: slow -->\n```text\nls\n```\n', r"x\.md:2: docs markers above a ```text block"),
])
def test_a_bad_marker_is_an_error_naming_the_doc_and_line(tmp_path, text, error):
    doc = tmp_path / "x.md"
    doc.write_text(text)
    with pytest.raises(ValueError, match=error):
        parse_doc(doc, root=tmp_path)
