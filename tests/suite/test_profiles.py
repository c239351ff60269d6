"""Parameter values are checked before a kernel starts: type from the default, `[allowed: ...]` and
`[each: ...]` checks from the comment (a safe evaluator), malformed profile YAML named by file and line."""
from __future__ import annotations

import json

import pytest

from decodelab.suite import cli, profiles, records, registry, runner

PARAMETERS = """\
max_new_tokens = 64  # new tokens per row [allowed: x >= 1]
top_p = 0.9  # nucleus mass [allowed: 0 < x <= 1]
batch_sizes = [1, 4, 16]  # batch sizes [each: x >= 1] [allowed: len(x) >= 1]
ks = [1, 2, 4, 8]  # fixed draft lengths to measure [each: x >= 1]
grid_category = "code_edit"  # workload of the sweep [allowed: x in ("code_edit", "extraction", "chat")]
draft_layers = None  # layers of the truncated draft, None = a third [allowed: x is None or x >= 1]
drafter_ks = {}  # per-drafter ks [each: len(x) >= 1 and min(x) >= 1]
model = "smollm2-135m"  # model name
greedy = True  # greedy decoding
extra = None  # anything
constant = DEFAULT_MODEL  # a constant defined in an earlier cell
seed = 0  # random seed
output_dir = None  # set by the runner
"""
DECLARED = profiles.parse_parameters(PARAMETERS)


def problems(name, value, source="-p"):
    return profiles.check_value(DECLARED[name], value, source=source)


def write_notebook(root, parameters=PARAMETERS, profile_text="max_new_tokens: 8\n"):
    """<root>/notebooks/00_quickstart.ipynb (the file name the registry knows) and its smoke profile."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("DEFAULT_MODEL = 'smollm2-135m'"),
        nbformat.v4.new_code_cell(parameters, metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("raise SystemExit('the kernel must never start in these tests')"),
    ]
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    notebooks = root / "notebooks"
    (notebooks / "params" / "quickstart").mkdir(parents=True)
    nbformat.write(nb, notebooks / "00_quickstart.ipynb")
    (notebooks / "params" / "quickstart" / "smoke.yaml").write_text(profile_text)
    return notebooks


@pytest.fixture
def notebook(tmp_path, monkeypatch):
    """A throwaway notebook registered as `quickstart`; returns the (not yet existing) results root."""
    notebooks = write_notebook(tmp_path)
    monkeypatch.setenv("DECODELAB_NOTEBOOKS", str(notebooks))
    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path / "results"))
    return tmp_path / "results"


# ---------------------------------------------------------------- types from the default
@pytest.mark.parametrize(
    "name, value",
    [("max_new_tokens", 5), ("top_p", 1), ("top_p", 0.5), ("batch_sizes", [2]), ("model", "Qwen/Qwen2.5-0.5B"),
     ("greedy", False), ("drafter_ks", {"ngram": [1, 2]}), ("extra", [1, "a"]), ("extra", None),
     ("constant", "my-model"), ("constant", 3), ("draft_layers", None), ("draft_layers", 2)],
)
def test_value_of_the_default_type_within_its_checks_is_accepted(name, value):
    assert problems(name, value) == []


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("max_new_tokens", "abc", "expected an integer, got a string"),
        ("max_new_tokens", True, "expected an integer, got a boolean"),
        ("max_new_tokens", 64.0, "expected an integer, got a number"),
        ("top_p", "high", "expected a number, got a string"),
        ("top_p", False, "expected a number, got a boolean"),
        ("batch_sizes", 4, "expected a list, got an integer"),
        ("drafter_ks", [1, 2], "expected a mapping, got a list"),
        ("model", 1.5, "expected a string, got a number"),
        ("greedy", 1, "expected true or false, got an integer"),
    ],
)
def test_value_of_another_type_is_rejected_naming_what_is_expected(name, value, expected):
    [message] = problems(name, value)
    assert message.startswith(f"-p {name}=") and expected in message
    assert f"default {DECLARED[name].display}" in message


def test_wrong_type_message_names_parameter_value_default_and_allowed():
    assert problems("max_new_tokens", "abc") == [
        "-p max_new_tokens='abc': expected an integer, got a string (default 64; allowed: x >= 1)"
    ]


@pytest.mark.parametrize("name", ["model", "max_new_tokens", "batch_sizes", "constant"])
def test_null_is_rejected_unless_the_default_is_none(name):
    [message] = problems(name, None)
    assert message.startswith(f"-p {name}=null: expected") and "only parameters whose default is None" in message
    assert problems("extra", None) == problems("draft_layers", None) == []


def test_scalar_for_a_list_parameter_shows_how_to_write_the_list():
    [message] = problems("batch_sizes", 4)
    assert message.endswith("a list is written -p batch_sizes=[4]")


def test_yaml_reading_a_string_parameter_as_bool_says_to_quote_it():
    [message] = problems("model", True)
    assert message.startswith("-p model=true: expected a string, got a boolean") and "quote it" in message


# ---------------------------------------------------------------- [allowed: ...] and [each: ...]
def test_checks_are_split_off_the_help_text():
    assert DECLARED["batch_sizes"].help == "batch sizes"
    checks = DECLARED["batch_sizes"].checks
    assert [(c.kind, c.expr) for c in checks] == [("each", "x >= 1"), ("allowed", "len(x) >= 1")]
    assert DECLARED["batch_sizes"].allowed_text == "each: x >= 1; allowed: len(x) >= 1"
    assert DECLARED["grid_category"].checks[0].expr == 'x in ("code_edit", "extraction", "chat")'
    assert DECLARED["model"].checks == () and DECLARED["model"].help == "model name"


def test_allowed_check_rejects_a_value_outside_it():
    assert problems("top_p", 1.5) == ["-p top_p=1.5: not allowed (allowed: 0 < x <= 1; default 0.9)"]
    assert problems("grid_category", "poetry") == [
        "-p grid_category='poetry': not allowed "
        "(allowed: x in (\"code_edit\", \"extraction\", \"chat\"); default \"code_edit\")"
    ]
    assert problems("draft_layers", 0) == [
        "-p draft_layers=0: not allowed (allowed: x is None or x >= 1; default None)"
    ]


def test_each_check_names_the_first_element_it_rejects():
    assert problems("ks", [0]) == ["-p ks=[0]: element ks[0]=0 is not allowed (each: x >= 1; default [1, 2, 4, 8])"]
    assert problems("ks", [1, 2, -1, 0]) == [
        "-p ks=[1, 2, -1, 0]: element ks[2]=-1 is not allowed (each: x >= 1; default [1, 2, 4, 8])"
    ]


def test_each_check_applies_to_every_value_of_a_mapping():
    [message] = problems("drafter_ks", {"ngram": [1], "layer_skip": [0, 1]})
    assert "element drafter_ks['layer_skip']=[0, 1] is not allowed" in message


def test_allowed_and_each_checks_both_apply():
    assert problems("batch_sizes", []) == [
        "-p batch_sizes=[]: not allowed (allowed: len(x) >= 1; default [1, 4, 16])"
    ]
    assert len(problems("batch_sizes", [0])) == 1


def test_a_check_that_raises_on_the_value_rejects_it():
    [message] = problems("draft_layers", "abc")
    assert message.startswith(
        "-p draft_layers='abc': not allowed (allowed: x is None or x >= 1; the check raised TypeError"
    )


def test_a_profile_value_names_the_profile_file(notebook, tmp_path):
    (tmp_path / "notebooks" / "params" / "quickstart" / "smoke.yaml").write_text("max_new_tokens: 0\nks: four\n")
    with pytest.raises(ValueError) as error:
        runner.prepare("quickstart", "smoke")
    path = tmp_path / "notebooks" / "params" / "quickstart" / "smoke.yaml"
    assert str(error.value).splitlines() == [
        f"{path}: max_new_tokens=0: not allowed (allowed: x >= 1; default 64)",
        f"{path}: ks='four': expected a list, got a string (default [1, 2, 4, 8]; each: x >= 1)",
    ]


def test_wrong_type_override_fails_before_kernel_starts(notebook, capsys):
    assert cli.main(["run", "quickstart", "--profile", "smoke", "-p", "max_new_tokens=abc"]) == 2
    assert capsys.readouterr().err == (
        "decodelab run: error: -p max_new_tokens='abc': expected an integer, got a string "
        "(default 64; allowed: x >= 1)\n"
    )
    assert not notebook.exists()  # no run folder, so no kernel


@pytest.mark.parametrize(
    "item, expected",
    [
        ("batch_sizes=4", "-p batch_sizes=4: expected a list, got an integer (default [1, 4, 16]; "
                          "each: x >= 1; allowed: len(x) >= 1); a list is written -p batch_sizes=[4]"),
        ("model=", "-p model=null: expected a string, got null (default \"smollm2-135m\"); "
                   "an empty value is YAML null, which only parameters whose default is None accept"),
        ("ks=[0]", "-p ks=[0]: element ks[0]=0 is not allowed (each: x >= 1; default [1, 2, 4, 8])"),
    ],
)
def test_bad_override_values_exit_2_with_their_message(notebook, capsys, item, expected):
    assert cli.main(["run", "quickstart", "--profile", "smoke", "-p", item]) == 2
    assert capsys.readouterr().err == f"decodelab run: error: {expected}\n"
    assert not notebook.exists()


def test_every_bad_value_is_reported_at_once(notebook):
    with pytest.raises(ValueError) as error:
        runner.prepare("quickstart", "smoke", {"top_p": 2, "ks": [0], "greedy": "yes"})
    lines = str(error.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["-p top_p=2", "-p ks=[0]", "-p greedy='yes'"]


# ---------------------------------------------------------------- the evaluator is safe
@pytest.mark.parametrize(
    "expr, reason",
    [
        ("__import__('os').system('touch pwned')", "calls __import__"),
        ("x.__class__", "uses Attribute"),
        ("open('f') is None", "calls open"),
        ("y > 1", "names 'y'"),
        ("(lambda: 1)() == 1", "calls lambda: 1"),
        ("x == (lambda: 1)", "uses Lambda"),
        ("[v for v in x] == x", "uses ListComp"),
        ("x ** 1000000 > 1", "uses Pow"),
        ("x >=", "does not parse as Python"),
        ("", "is empty"),
    ],
)
def test_unsafe_or_unparsable_check_is_an_error_naming_notebook_and_parameter(tmp_path, expr, reason):
    notebooks = write_notebook(tmp_path, f"k = 1  # a count [allowed: {expr}]\noutput_dir = None  # runner\n")
    with pytest.raises(ValueError) as error:
        profiles.notebook_parameters(notebooks / "00_quickstart.ipynb")
    message = str(error.value)
    assert message.startswith("00_quickstart.ipynb: parameter 'k': the check [allowed:") and reason in message
    assert not (tmp_path / "pwned").exists()


def test_unclosed_check_is_an_error():
    with pytest.raises(ValueError, match=r"parameter 'k': the check '\[each: x >= 1' has no closing"):
        profiles.parse_parameters("k = [1]  # counts [each: x >= 1\n")


def test_brackets_and_quotes_inside_a_check_do_not_end_it():
    [param] = profiles.parse_parameters('mode = "a"  # mode [allowed: x in ["a]", "b"]] (see docs)\n').values()
    assert param.checks[0].expr == 'x in ["a]", "b"]' and param.help == "mode (see docs)"
    assert profiles.check_value(param, "a]") == [] and profiles.check_value(param, "c") != []


def test_checks_see_only_x_and_the_whitelisted_functions():
    check = profiles.Check.parse("allowed", "isinstance(x, int) and abs(x) in sorted([1, 2, 3])")
    assert check.passes(-2) == (True, "") and check.passes("2")[0] is False


# ---------------------------------------------------------------- malformed profile YAML
def test_malformed_profile_yaml_names_file_and_line(tmp_path):
    (tmp_path / "smoke.yaml").write_text("# tests\nmax_new_tokens: [1,\n")
    with pytest.raises(ValueError) as error:
        profiles.load_profile(tmp_path, "smoke")
    assert str(error.value) == (
        f"profile file {tmp_path / 'smoke.yaml'}: line 2: not valid YAML (while parsing a flow node, "
        "expected the node content, but found '<stream end>'): 'max_new_tokens: [1,'"
    )


def test_malformed_profile_yaml_in_the_middle_names_its_line(tmp_path):
    (tmp_path / "cpu.yaml").write_text("a: 1\n  b: 2\nc: 3\n")
    expected = r"cpu.yaml: line 2: not valid YAML \(mapping values are not allowed here\): 'b: 2'"
    with pytest.raises(ValueError, match=expected):
        profiles.load_profile(tmp_path, "cpu")


def test_malformed_profile_yaml_exits_2_without_traceback(notebook, tmp_path, capsys):
    (tmp_path / "notebooks" / "params" / "quickstart" / "smoke.yaml").write_text("max_new_tokens: [1,\n")
    assert cli.main(["run", "quickstart", "--profile", "smoke"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodelab run: error: profile file ") and "smoke.yaml: line 1: not valid YAML" in err
    assert "Traceback" not in err and not notebook.exists()


def test_parameters_cell_that_does_not_parse_is_named(tmp_path):
    notebooks = write_notebook(tmp_path, "k = [1,  # broken\n")
    with pytest.raises(ValueError, match=r"00_quickstart.ipynb: the parameters cell does not parse \(line 1"):
        profiles.notebook_parameters(notebooks / "00_quickstart.ipynb")


# ---------------------------------------------------------------- the committed notebooks
PRESENT = [name for name, file in registry.NOTEBOOKS.items() if (records.notebooks_dir() / file.file).exists()]


@pytest.mark.parametrize("name", PRESENT)
def test_committed_notebook_checks_parse_and_hold_for_defaults_and_profiles(name):
    declared = records.parameters(name)  # raises on a check that does not parse or is unsafe
    defaults = {n: p.default for n, p in declared.items() if p.is_literal and n not in profiles.RESERVED}
    bad_defaults = [msg for n, v in defaults.items() for msg in profiles.check_value(declared[n], v, source="default")]
    assert not bad_defaults, bad_defaults
    for profile in profiles.available_profiles(records.params_dir(name)):
        values = profiles.load_profile(records.params_dir(name), profile)
        profiles.validate(values, declared, source=f"{name}/{profile}.yaml")


@pytest.mark.parametrize("name", PRESENT)
def test_committed_profiles_hold_only_values_that_differ_from_the_notebook(name):
    """Defaults once: a profile entry equal to the parameters cell's default (a non-literal default such as
    DEFAULT_MODEL compared by its value) is a second copy that can drift; delete it."""
    defaults = profiles.evaluated_defaults(records.notebook_path(name))
    for profile in profiles.available_profiles(records.params_dir(name)):
        values = profiles.load_profile(records.params_dir(name), profile)
        same = profiles.redundant_entries(values, defaults)
        assert not same, f"notebooks/params/{name}/{profile}.yaml repeats the notebook's defaults: {same}"


def test_redundant_entries_compare_parsed_values_and_types():
    defaults = {"n": 4, "lr": 0.01, "on": True, "one": 1, "grid": [1, 2], "model": "smollm2-135m"}
    values = {"n": 4, "lr": 1e-2, "on": 1, "one": True, "grid": [1, 2, 4], "model": "smollm2-135m"}
    assert profiles.redundant_entries(values, defaults) == ["n", "lr", "model"]


def test_non_literal_default_evaluates_to_the_imported_constant():
    from decodelab.core.models import DEFAULT_MODEL

    declared = records.parameters("quickstart")
    assert declared["model"].source == "DEFAULT_MODEL" and not declared["model"].is_literal
    assert profiles.evaluated_defaults(records.notebook_path("quickstart"))["model"] == DEFAULT_MODEL == "smollm2-135m"


def test_real_quickstart_rejects_bad_values_before_the_model_loads(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODELAB_RESULTS", str(tmp_path / "results"))
    for item, start in [("max_new_tokens=abc", "-p max_new_tokens='abc': expected an integer"),
                        ("batch_sizes=4", "-p batch_sizes=4: expected a list"),
                        ("model=", "-p model=null: expected a value")]:
        with pytest.raises(ValueError) as error:
            runner.execute("quickstart", "smoke", profiles.parse_overrides([item]), log=lambda *_: None)
        assert str(error.value).startswith(start)
    assert not (tmp_path / "results").exists()


def test_real_speculation_rejects_a_zero_draft_length():
    declared = records.parameters("speculation")
    if not any(check.kind == "each" for check in declared["ks"].checks):
        pytest.skip("notebook 01 does not declare [each: x >= 1] on ks yet (its owner adds it)")
    with pytest.raises(ValueError, match=r"^-p ks=\[0\]: element ks\[0\]=0 is not allowed \(each: "):
        runner.prepare("speculation", "smoke", {"ks": [0]})


def test_list_shows_checks_apart_from_the_help(notebook, capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "batch_sizes    = [1, 4, 16]  # batch sizes  (each: x >= 1; allowed: len(x) >= 1)" in out
    assert "[each:" not in out and "[allowed:" not in out


def test_params_json_of_a_prepared_run_is_plain_json(notebook):
    _, injected, merged = runner.prepare("quickstart", "smoke", {"ks": [2]})
    assert injected == {"max_new_tokens": 8, "ks": [2]}
    assert json.loads(json.dumps(merged))["constant"] == "DEFAULT_MODEL"
