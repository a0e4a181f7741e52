"""Tests of the multidomain corpus builder on a small fake install, and of group splits."""
from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import replace
from importlib.metadata import PathDistribution
from pathlib import Path
from typing import Dict, List

import pytest

from dipaco.config import DataConfig
from dipaco.data import DataError, load_corpus, split_of
from dipaco.data import multidomain
from dipaco.data.multidomain import DOMAINS, DomainDocument, discover, load_multidomain

EXCLUDES = ["test"]
PROSE = ("The quick brown fox jumps over the lazy dog, and the dog does not mind it at all. "
         "This is the kind of sentence that the prose filter should keep in the corpus. ") * 6


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _dist(site: Path, name: str, files: Dict[str, str]) -> PathDistribution:
    """A dist-info folder whose RECORD lists ``files`` (written under ``site``)."""
    info = f"{name}-1.0.dist-info"
    for rel, text in files.items():
        _write(site / rel, text)
    record = [f"{rel},," for rel in files] + [f"{info}/RECORD,,"]
    _write(site / info / "RECORD", "\n".join(record) + "\n")
    return PathDistribution(site / info)


@pytest.fixture()
def fake_install(tmp_path, monkeypatch) -> Path:
    """A stdlib, C include dir and two distributions in ``tmp_path``; the cache under it."""
    std, inc, site = tmp_path / "stdlib", tmp_path / "include", tmp_path / "site"
    code = "".join(f"def func_{i}(x):\n    '''Return x plus {i}.'''\n    return x + {i}\n\n\n" for i in range(40))
    _write(std / "json" / "decoder.py", code)
    _write(std / "argparse.py", code.replace("func_", "parse_"))
    _write(std / "test" / "test_json.py", code)  # excluded package
    _write(std / "pydoc_data" / "topics.py",
           "topics = {'if': " + repr("The if statement. " * 30) + ", 'for': " + repr("The for loop. " * 30) + "}\n")
    _write(std / "LICENSE.txt", PROSE)
    _write(inc / "Python.h", "#include <stdio.h>\n" + "static int py_value_%d = 0;\n" * 60)
    _write(inc / "cpython" / "object.h", "typedef struct _object { long refcnt; } PyObject;\n" * 40)
    module = ('"""' + PROSE[:300] + '"""\n\n\nclass Fake:\n    """A fake class whose docstring is long enough to keep."""\n\n'
              '    def run(self, n):\n        """Run the fake ``n`` times and return the number of runs made."""\n'
              '        return n\n')
    pkg = _dist(site, "fakepkg", {
        "fakepkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n\n" + PROSE,
        "fakepkg-1.0.dist-info/LICENSE": "Apache License\n" + PROSE[::-1] + "\nthe end of the license text " * 20,
        "fakepkg/__init__.py": module,
        "fakepkg/tests/test_core.py": module,  # test code gives no reference docs
        "fakepkg/include/fake.hpp": "namespace fake { int value = 1; }\n" * 50,
        "fakepkg/data/table.json": json.dumps([{"k": i, "v": f"value {i}"} for i in range(60)]),
        "fakepkg/data/conf.yaml": "".join(f"key_{i}: {i}\n" for i in range(80)),
        "fakepkg/data/numbers.txt": "".join(f"{i} {i * i} {i * 3.5}\n" for i in range(200)),  # not prose
        "fakepkg/README.md": "# Fakepkg\n\n" + PROSE,
        "fakepkg/docs/guide.rst": "Guide\n=====\n\n" + "Use :func:`fake.run` to run. " * 40,
    })
    other = _dist(site, "other", {
        "other-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: other\nVersion: 1.0\n\nShort.\n",
        "other-1.0.dist-info/LICENSE": "Apache License\n" + PROSE[::-1] + "\nthe end of the license text " * 20,
        "other/bits.h": "#define OTHER_BIT(n) (1u << (n))\n" * 50,
    })
    monkeypatch.setattr(multidomain, "discover",
                        lambda exclude, **kw: discover(exclude, str(std), str(inc), [pkg, other]))
    monkeypatch.setenv("DIPACO_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _load(**kw) -> List[DomainDocument]:
    return load_multidomain(EXCLUDES, target_doc_chars=kw.pop("target", 600), max_doc_chars=4000, **kw)[0]


def test_domains_labels_and_groups(fake_install) -> None:
    docs = _load()
    by_label = {d: [x for x in docs if x.label == d] for d in DOMAINS}
    assert all(by_label.values()), {d: len(v) for d, v in by_label.items()}
    groups = {d: {x.group for x in v} for d, v in by_label.items()}
    assert groups["python"] == {"python/stdlib/argparse.py", "python/stdlib/json/decoder.py"}
    assert groups["c_cpp"] == {"c_cpp/include/Python.h", "c_cpp/include/cpython/object.h",
                               "c_cpp/fakepkg/fakepkg/include/fake.hpp", "c_cpp/other/other/bits.h"}
    # two identical licenses: one kept; numbers.txt is no prose; METADATA headers are left out
    assert len([g for g in groups["prose"] if g.endswith("/LICENSE")]) == 1
    assert "prose/fakepkg/fakepkg/data/numbers.txt" not in groups["prose"]
    assert "prose/fakepkg/fakepkg/README.md" in groups["prose"]
    assert not any("Metadata-Version" in x.text for x in by_label["prose"])
    # the language reference: one group per topic; docstrings of the dependency, not of its tests
    assert {"reference_docs/stdlib/pydoc_data/topics.py::if",
            "reference_docs/stdlib/pydoc_data/topics.py::for"} <= groups["reference_docs"]
    assert "reference_docs/fakepkg/fakepkg/__init__.py" in groups["reference_docs"]
    assert not any("tests" in g for g in groups["reference_docs"])
    assert any("Fake.run\nRun the fake" in x.text for x in by_label["reference_docs"])
    assert {"structured_data/fakepkg/fakepkg/data/table.json", "structured_data/fakepkg/fakepkg/data/conf.yaml",
            "structured_data/fakepkg/fakepkg-1.0.dist-info/RECORD"} <= groups["structured_data"]
    assert not any("test_json" in x.id for x in docs)  # data.exclude_packages
    assert len({x.id for x in docs}) == len(docs)
    assert all(x.id.startswith(x.group + "#") for x in docs)


def test_build_is_deterministic_and_cached(fake_install, monkeypatch) -> None:
    first, path = load_multidomain(EXCLUDES, 600, 4000)
    os.remove(path)
    second, path2 = load_multidomain(EXCLUDES, 600, 4000)
    assert first == second and path == path2  # two builds give the same documents

    def no_build(*a, **k):
        raise AssertionError("a cache hit must not rebuild")

    monkeypatch.setattr(multidomain, "build", no_build)
    assert load_multidomain(EXCLUDES, 600, 4000)[0] == first
    # a damaged cache file is built again, not crashed on
    with open(path, "w") as f:
        f.write('{"id": "half a line')
    with pytest.raises(AssertionError, match="must not rebuild"):
        load_multidomain(EXCLUDES, 600, 4000)
    # a changed install (a file grows) has another fingerprint: it rebuilds
    with open(fake_install / "include" / "Python.h", "a") as f:
        f.write("static int added;\n")
    with pytest.raises(AssertionError, match="must not rebuild"):
        load_multidomain(EXCLUDES, 600, 4000)


@pytest.mark.slow
def test_the_build_logs_its_progress_and_prints_nothing(fake_install, capsys, caplog) -> None:
    """A first build says so through dipaco's logger (its ``[dipaco]`` lines, the run's
    train.log), not with print calls of its own; a cached load says nothing."""
    with caplog.at_level(logging.INFO, logger="dipaco"):
        load_multidomain(EXCLUDES, 600, 4000, progress=True)
        load_multidomain(EXCLUDES, 600, 4000, progress=True)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("multidomain:")]
    assert len(said) == 2 and "first build" in said[0] and "documents" in said[1]
    printed = [x for x in capsys.readouterr().out.splitlines() if "multidomain:" in x]
    assert all(x.startswith("[dipaco] multidomain:") for x in printed)


@pytest.mark.slow  # builds the corpus twice: out of the fast lane
def test_parallel_build_equals_sequential_build(fake_install) -> None:
    """Worker processes read and cut the files; the corpus, the cap and the skip counts are
    those of a build in one process (the parent keeps the files' order)."""
    _write(fake_install / "stdlib" / "gen.py", "# Auto-generated\n" + "x = 1\n" * 50)
    _write(fake_install / "stdlib" / "copy_of_argparse.py", (fake_install / "stdlib" / "argparse.py").read_text())
    candidates = multidomain.discover(EXCLUDES)
    for cap in (10**9, 1500):
        one: Dict[str, int] = {}
        two: Dict[str, int] = {}
        seq = multidomain.build(candidates, 600, 4000, cap, one, workers=1)
        par = multidomain.build(candidates, 600, 4000, cap, two, workers=2)
        assert seq == par and one == two
        if cap == 10**9:  # uncapped, every file is reached: the copy and the shared license
            assert one["generated_file"] == 1 and one["duplicate_file"] == 2, one


def test_unwritable_cache_is_one_line_error(fake_install, monkeypatch) -> None:
    blocker = fake_install / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv("DIPACO_CACHE", str(blocker))
    with pytest.raises(DataError, match=r"multidomain cache.*Fix: set DIPACO_CACHE") as e:
        load_multidomain(EXCLUDES, 600, 4000)
    assert "\n" not in str(e.value)


def test_generated_code_is_left_out_of_code_domains_only(fake_install) -> None:
    """A generator's marker at the top of a code file drops it; the same marker in the
    language reference (Sphinx writes one into pydoc_data/topics.py) does not."""
    std, inc = fake_install / "stdlib", fake_install / "include"
    body = "".join(f"def tok_{i}(x):\n    return x * {i}\n\n\n" for i in range(40))
    _write(std / "token.py", "# Auto-generated by Tools/build/generate_token.py\n" + body)
    _write(inc / "ops" / "add.h", "#pragma once\n// @generated by gen.py from Template.h\n"
           + "int add_op_%d(int a, int b);\n" * 60)
    topics = (std / "pydoc_data" / "topics.py").read_text()
    _write(std / "pydoc_data" / "topics.py", "# Autogenerated by Sphinx on Mon Jan 1 00:00:00 2024\n" + topics)
    docs = _load()
    groups = {x.group for x in docs}
    assert "python/stdlib/token.py" not in groups
    assert "c_cpp/include/ops/add.h" not in groups
    assert "python/stdlib/argparse.py" in groups and "c_cpp/include/Python.h" in groups
    assert "reference_docs/stdlib/pydoc_data/topics.py::if" in groups


def test_record_documents_do_not_depend_on_the_installer(fake_install) -> None:
    """Two installs of the same wheel in two places (or by pip and by uv) build the same
    corpus: the RECORD lines an installer writes (console scripts whose shebang names the
    interpreter, byte code, INSTALLER / REQUESTED / direct_url.json) are left out."""
    record = fake_install / "site" / "fakepkg-1.0.dist-info" / "RECORD"
    wheel_lines = record.read_text()
    before = _load()

    def installed(python: str, requested: bool) -> str:
        info = "fakepkg-1.0.dist-info"
        lines = [f"../../../bin/fake,sha256={python},{len(python) + 40}",
                 "fakepkg/__pycache__/__init__.cpython-311.pyc,,", f"{info}/INSTALLER,sha256=zS,4",
                 f"{info}/direct_url.json,sha256={python[::-1]},77"] + ([f"{info}/REQUESTED,,"] if requested else [])
        return wheel_lines + "\n".join(lines) + "\n"

    record.write_text(installed("AbC1venvA", requested=True))
    first = _load()
    record.write_text(installed("zYx9otherB", requested=False))
    second = _load()
    assert first == second == before
    assert "fakepkg/__init__.py,," in "".join(x.text for x in first if x.group.endswith("/RECORD"))


@pytest.mark.parametrize("head, generated", [
    ("// @generated by torchgen/gen.py from Function.h\n", True),
    ("# Code generated by protoc-gen-go. DO NOT EDIT.\n", True),
    ("/* Generated by Cython 3.0.10 */\n", True),
    ("# This file is autogenerated by the command `make fix-copies`\n", True),
    ("# Copyright 2024 The Authors.\n\ndef generate(x):\n    return x\n", False),
    ("/* Tokens generated by the lexer are kept in a table. */\n", False),
])
def test_is_generated_reads_the_generator_markers(head: str, generated: bool) -> None:
    assert multidomain.is_generated(head + "int x;\n" * 10) is generated
    # a marker far below the head is quoted text, not a generator's stamp
    assert not multidomain.is_generated("int x;\n" * 400 + head)


def test_domain_cap_limits_each_domain(fake_install) -> None:
    full = _load()
    capped = _load(domain_max_chars=1500)
    for d in DOMAINS:
        size = sum(len(x.text) for x in capped if x.label == d)
        # the cap stops reading files once reached: at most one file beyond it
        biggest_file = max(sum(len(x.text) for x in full if x.group == g) for g in {x.group for x in full})
        assert size <= 1500 + biggest_file
    c_full = {x.group for x in full if x.label == "c_cpp"}
    c_capped = {x.group for x in capped if x.label == "c_cpp"}
    assert c_capped < c_full  # a strict subset: files were left out


def test_load_corpus_multidomain_splits_by_file(fake_install) -> None:
    cfg = replace(DataConfig(), source="multidomain", exclude_packages=EXCLUDES, target_doc_chars=300,
                  min_doc_chars=1, val_fraction=0.3, test_fraction=0.3)
    c = load_corpus(cfg, progress=False)
    assert c.labels == sorted(DOMAINS)
    ds = c.dataset
    split_of_group: Dict[str, set] = {}
    for g, s in zip(ds["group"], ds["split"]):
        split_of_group.setdefault(g, set()).add(s)
    assert all(len(s) == 1 for s in split_of_group.values())
    assert len({s for v in split_of_group.values() for s in v}) == 3


def test_group_field_keeps_each_group_in_one_split(tmp_path) -> None:
    """Property test (fixed seed): whatever the group sizes, no group is in two splits."""
    rng = random.Random(0)
    rows = [{"text": f"document {i} " * 10, "file": f"f{rng.randrange(80)}"} for i in range(600)]
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = replace(DataConfig(), source="jsonl", path=str(f), group_field="file",
                  val_fraction=0.2, test_fraction=0.2)
    c = load_corpus(cfg, progress=False)
    seen: Dict[str, str] = {}
    for g, s in zip(c.dataset["group"], c.dataset["split"]):
        assert seen.setdefault(g, s) == s
        assert s == split_of(g, 0.2, 0.2)
    assert set(seen.values()) == {"train", "validation", "test"}
    # capped by max_documents (a sample of documents): still no group in two splits
    capped = load_corpus(replace(cfg, max_documents=100), progress=False)
    assert all(seen[g] == s for g, s in zip(capped.dataset["group"], capped.dataset["split"]))
    # without group_field every document is its own group (the old id split)
    plain = load_corpus(replace(cfg, group_field=None), progress=False)
    assert plain.dataset["group"] == plain.dataset["id"]
    with pytest.raises(DataError, match=r"data\.group_field='nope'.*Fix"):
        load_corpus(replace(cfg, group_field="nope"), progress=False)


@pytest.mark.slow
def test_real_install_small_build(tmp_path, monkeypatch) -> None:
    """The real stdlib and dependencies, capped small: every domain gets documents."""
    monkeypatch.setenv("DIPACO_CACHE", str(tmp_path))
    docs, path = load_multidomain(["test", "tests", "idlelib", "lib2to3", "turtledemo"],
                                  2400, 20000, domain_max_chars=150_000)
    assert os.path.isfile(path)
    for d in DOMAINS:
        size = sum(len(x.text) for x in docs if x.label == d)
        assert size >= 20_000, (d, size)


@pytest.mark.slow
def test_default_config_trains_on_multidomain(fake_install, tmp_path) -> None:
    """The default corpus end to end (on the fake install): routed, trained, scored, and the
    routing report measures NMI against the five domains."""
    from dipaco.config import compose_config
    from dipaco.job.train import train

    assert compose_config([], tmp_path / "unused").data.source == "multidomain"  # the default
    run = tmp_path / "run"
    cfg = compose_config(["experiment=smoke", "data=multidomain", "data.max_documents=null",
                          f"data.exclude_packages={EXCLUDES}", "data.target_doc_chars=200",
                          "data.min_doc_chars=1", "data.val_fraction=0.2", "data.test_fraction=0.1",
                          "trainer.rounds=1", "trainer.dense_baseline=false", "trainer.plots=false"], run)
    summary = train(cfg)
    assert 1.0 < summary["routed_ppl"] < 512
    report = json.loads((run / "routing_report.json").read_text())
    assert report["num_documents"] > 0 and 0.0 <= report["nmi"] <= 1.0


def test_the_corpus_packages_are_the_configs_not_dipacos_requirements(tmp_path, monkeypatch, caplog) -> None:
    """``data.packages`` names the distributions read, so a requirement added to dipaco's
    setup.cfg leaves the default corpus as it was (adding simpy once moved every result);
    a named one that is not installed is left out with a warning that says so."""
    from dipaco.data.domain_files import package_closure

    seen: list = []
    monkeypatch.setattr(multidomain, "discover", lambda exclude, **kw: seen.append(kw) or [])
    monkeypatch.setattr(multidomain, "build", lambda *a, **k: [])
    monkeypatch.setenv("DIPACO_CACHE", str(tmp_path))
    with caplog.at_level("WARNING", logger="dipaco"):
        load_multidomain(EXCLUDES, packages=["tqdm", "no-such-distribution-xyz"])
    names = {d.metadata["Name"].lower() for d in seen[0]["distributions"]}
    assert "tqdm" in names and "torch" not in names and "dipaco" not in names
    assert "no-such-distribution-xyz not installed" in caplog.text
    dists, missing = package_closure(["torch", "no-such-distribution-xyz"])
    assert missing == ["no-such-distribution-xyz"]
    assert {"torch", "filelock"} <= {d.metadata["Name"].lower() for d in dists}  # torch's own requirements too
    assert DataConfig().packages and "dipaco" not in DataConfig().packages


def test_the_corpus_packages_are_not_a_fingerprint_key() -> None:
    """What ``data.packages`` changes is the documents, which the data fingerprint holds: a
    run recorded before the key existed resumes when its corpus is the same (found by
    resuming the README's default run of the day before: refused on ``made with None``)."""
    from dipaco.config import compose_config
    from dipaco.run.fingerprint import artefact_depends, config_keys

    assert not any(artefact_depends("data.packages", a) for a in ("tokenizer", "router", "shards", "warmup",
                                                                   "checkpoints"))
    assert "data.packages" not in config_keys(compose_config([]), "tokenizer")
    assert "data.domain_max_chars" in config_keys(compose_config([]), "tokenizer")  # the rule still reads data.*
