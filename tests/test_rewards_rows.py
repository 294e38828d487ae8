"""How a reward function receives a data row: no collision with the framework's arguments, the row as one
argument, only the fields a signature takes, clear errors for fields it needs, sibling imports (issue 16)."""

from __future__ import annotations

import pytest

from hybridflow.rewards import RewardError, RuleReward, load_reward_function


def documented_reward(prompt: str, response: str, **extra_fields) -> float:
    return float(response == extra_fields["row_response"]) + 10.0 * float(extra_fields["answer"] == "2")


def row_reward(prompt: str, response: str, *, row: dict) -> float:
    return float(response == row["response"]) + 10.0 * float(row["prompt"] == "extra prompt field")


def named_reward(prompt: str, response: str, *, answer: str, scale: float = 1.0) -> float:
    return scale * float(response.strip() == answer)


def test_a_row_field_named_response_reaches_a_documented_function_as_row_response():
    rows = [{"answer": "2", "response": "2"}, {"answer": "4", "response": "gold"}]
    scores = RuleReward(documented_reward).score_batch(["1+1=", "2+2="], ["2", "5"], rows)
    assert scores.tolist() == [11.0, 0.0]


def test_a_function_with_a_row_parameter_gets_the_whole_row_including_colliding_fields():
    rows = [{"response": "yes", "prompt": "extra prompt field"}, {"response": "no", "prompt": "other"}]
    scores = RuleReward(row_reward).score_batch(["p0", "p1"], ["yes", "yes"], rows)
    assert scores.tolist() == [11.0, 0.0]


def test_a_function_naming_its_fields_gets_only_those_and_ignores_the_rest_of_the_row():
    rows = [{"answer": "7", "id": 3, "response": "x"}, {"answer": "8", "id": 4, "scale": 2.0}]
    scores = RuleReward(named_reward).score_batch(["3+4=", "4+4="], [" 7", "8"], rows)
    assert scores.tolist() == [1.0, 2.0]


def test_a_row_missing_a_required_field_is_a_reward_error_naming_the_field_and_the_row():
    with pytest.raises(RewardError, match=r"requires the row field\(s\) \['answer'\] but sample 1's row has "
                                          r"\['id'\] \(prompt '2\+2='\); allowed: give those parameters a default"):
        RuleReward(named_reward).score_batch(["1+1=", "2+2="], ["2", "4"], [{"answer": "2"}, {"id": 1}])


def test_the_positional_names_a_function_chose_are_the_ones_that_cannot_collide():
    reward = RuleReward(lambda p, r, **fields: float(fields["row_p"] == "kept" and fields["response"] == r))
    assert reward.score_batch(["q"], ["a"], [{"p": "kept", "response": "a"}]).tolist() == [1.0]


def test_a_reward_file_can_import_a_module_next_to_it(tmp_path):
    (tmp_path / "sibling_helpers_for_reward.py").write_text("def normalise(text):\n    return text.strip()\n")
    (tmp_path / "my_reward.py").write_text(
        "from sibling_helpers_for_reward import normalise\n\n"
        "def exact(prompt, response, *, answer):\n    return float(normalise(response) == answer)\n")
    function = load_reward_function(f"{tmp_path / 'my_reward.py'}:exact")
    assert function("1+1=", " 2 ", answer="2") == 1.0
