from gpufleet.rewards import answer_format, answer_match, completion_answer, reference_answer


def test_reference_and_completion_answers():
    assert reference_answer("She has 3 + 4 = 7 apples.\n#### 7") == "7"
    assert reference_answer("1,234") == "1234"
    assert completion_answer("so it is <answer>42</answer>.") == "42"
    assert completion_answer("12 then 15.50") == "15.5"
    assert completion_answer("no digits") is None


def test_answer_match_and_format():
    c = ["<answer>7</answer>", "it is 8", "", "7.0"]
    assert answer_match([""] * 4, c, answer=["#### 7"] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert answer_match([""] * 2, c[:2]) == [None, None]
    assert answer_format([""] * 4, c) == [0.2, 0.0, 0.0, 0.0]
