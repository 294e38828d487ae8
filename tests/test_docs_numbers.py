"""Every number a doc states as a measurement names the command that produced it (issue 18).

The rule is in tests/docs_numbers.py. A number that is a setting or a fact, not a measurement,
goes in NOT_MEASURED with its reason.
"""

from __future__ import annotations

from docs_numbers import MEASURED, numbers_without_command, sections_of, slug

NOT_MEASURED: dict[tuple[str, str], str] = {
    ("docs/dataproto.md", "256 x"): "a batch shape (256 x 2048), not a speed-up",
    ("docs/dataproto.md", "4 MiB"): "arithmetic: 256 x 2048 int64 values are 4 MiB",
    ("docs/demo.md", "70%"): "the default of drop_final_carry_rate, a setting",
    ("docs/failures.md", "3600 s"): "the default call timeout of a worker group, a setting",
    ("docs/failures.md", "60 s"): "the default placement timeout of a resource pool, a setting",
    ("docs/generation.md", "80%"): "the share of free memory memory_budget_gib=null uses, a setting",
    ("docs/rewards.md", "300 s"): "the default reward timeout, a setting (and the error message it gives)",
    ("docs/mapping.md", "14%"): "computed by the test it names (docs/mapping.md belongs to the mapping work)",
    ("benchmarks/README.md", "6 x"): "the FLOP formula (6 x parameters x tokens), not a speed-up",
    ("benchmarks/README.md", "24 GiB"): "the machine's RAM, a fact about the machine",
}


def test_every_measured_number_in_the_docs_names_its_command():
    missing = numbers_without_command(NOT_MEASURED)
    assert not missing, ("numbers stated as measurements with no command in their section (add a Command: line, "
                         "a code block, or a link to the benchmark section that has one):\n" + "\n".join(missing))


def test_the_rule_finds_units_outside_code_and_accepts_commands_and_linked_sections(tmp_path, monkeypatch):
    import docs_numbers

    doc = tmp_path / "guide.md"
    doc.write_text("# Guide\n\n## Speed\n\nIt took 3.1 min and 94.5% passed; `timeout_s=300 s` is a setting.\n\n"
                   "## Proof\n\n`hybridflow demo` gave 37.1%.\n\n## Linked\n\nSee [there](#proof): 2.5x faster.\n\n"
                   "## Dangling\n\nSee [nowhere](#missing): 12 GiB.\n\n## Indented\n\n    python bench.py\n\nIt ran at 9 tok/s.\n")
    monkeypatch.setattr(docs_numbers, "REPO", tmp_path)
    monkeypatch.setattr(docs_numbers, "number_docs", lambda: [doc])
    sections = sections_of(doc)
    assert [(s.heading, s.numbers, s.has_command) for s in sections[1:]] == [
        ("Guide", [], False), ("Speed", [(5, "3.1 min"), (5, "94.5%")], False), ("Proof", [(9, "37.1%")], True),
        ("Linked", [(13, "2.5x")], False), ("Dangling", [(17, "12 GiB")], False),
        ("Indented", [(23, "9 tok/s")], True)]
    assert numbers_without_command({}) == ['guide.md:5: "3.1 min" (section "Speed")',
                                           'guide.md:5: "94.5%" (section "Speed")',
                                           'guide.md:17: "12 GiB" (section "Dangling")']
    assert numbers_without_command({("guide.md", "3.1 min"): "a setting", ("guide.md", "94.5%"): "a setting",
                                    ("guide.md", "12 GiB"): "the RAM"}) == []


def test_anchors_are_github_slugs_and_units_need_a_number():
    assert slug("Measured (2-core CPU, no GPU)") == "measured-2-core-cpu-no-gpu"
    assert slug("`hybridflow demo`: the whole pipeline") == "hybridflow-demo-the-whole-pipeline"
    assert [m.group(0) for m in MEASURED.finditer("x 4 heads, 16 s, 1,024 MB, 3x, v1.5%, max 2 h")] == [
        "16 s", "1,024 MB", "3x", "2 h"]
