"""OPD teacher-path rows (kiln.training.opd.paths): what a scored draft proves, teacher-only discovery, checkpoints."""

from __future__ import annotations

from kiln.training.opd.paths import TeacherPaths, teacher_top1

END = 0


def _row(best: int, *others: int) -> dict[int, float]:
    """A teacher row whose top-1 is ``best``."""
    return {best: -0.1, **{o: -3.0 - i for i, o in enumerate(others)}}


def test_a_draft_proves_its_agreeing_prefix_plus_the_teachers_token_where_it_diverges():
    paths = TeacherPaths(2, [END])
    # the teacher's greedy answer is 5 6 7 END; the draft says 5 6 9 ...: it proves 5 6 7
    paths.observe(0, [5, 6, 9, 4], [_row(5), _row(6, 9), _row(7, 9), _row(8)])
    assert paths.prefix(0) == [5, 6, 7] and not paths.complete(0)
    assert paths.prefix(1) == []
    # a shorter proof, or one that contradicts the known prefix, changes nothing
    paths.observe(0, [3], [_row(5, 3)])
    paths.observe(0, [5, 1, 1, 1, 1], [_row(5), _row(1), _row(1), _row(1), _row(1)])
    assert paths.prefix(0) == [5, 6, 7]
    # the known prefix, then the student's sample from it: the row extends the path through END
    paths.observe(0, [5, 6, 7, END, 9], [_row(5), _row(6), _row(7), _row(END), _row(9)])
    assert paths.prefix(0) == [5, 6, 7, END] and paths.complete(0)
    paths.observe(0, [5, 6, 7, 2, 2, 2], [_row(5), _row(6), _row(7), _row(2), _row(2), _row(2)])
    assert paths.prefix(0) == [5, 6, 7, END]  # complete: never extended


def test_rows_to_sample_and_checkpoint_round_trip():
    paths = TeacherPaths(3, [END])
    paths.observe(0, [5, 6], [_row(5), _row(6)])  # agrees to the end of the draft (max_tokens reached)
    paths.observe(2, [4], [_row(END)])  # the teacher's answer is empty: END at once
    assert paths.prefix(0) == [5, 6] and paths.prefix(2) == [END]
    # prompt 1 has no path yet (no row); prompt 2's path is whole (the row is the path, nothing to sample)
    assert paths.rows_to_sample([0, 1, 2], max_tokens=8) == [(0, [5, 6], 6), (2, [END], 0)]
    assert paths.rows_to_sample([0], max_tokens=2) == [(0, [5, 6], 0)]
    again = TeacherPaths(3, [END])
    again.load_tensor(paths.to_tensor())
    assert again.paths == paths.paths and again.complete(2)
    assert teacher_top1({}) is None and teacher_top1({4: -1.0, 2: -1.0}) == 2


def test_discover_finishes_the_chosen_paths_with_the_teacher_alone():
    """One teacher call per round for every unfinished chosen path; each adds the teacher's top-1 after the
    prefix; a path stops at END or at max_tokens; whole paths cost no call."""
    answers = {0: [5, 6, END], 1: [7, 7, 7, 7, 7, 7]}
    calls: list[list[tuple[int, list[int]]]] = []

    def score_next(todo):
        calls.append(todo)
        return [_row(answers[i][len(known)], 9) for i, known in todo]

    paths = TeacherPaths(3, [END])
    paths.observe(0, [5, 4], [_row(5), _row(6)])  # already known: 5 6
    assert paths.discover([0, 1, 0], 4, score_next) == 4
    assert paths.prefix(0) == [5, 6, END] and paths.complete(0)
    assert paths.prefix(1) == [7, 7, 7, 7] and not paths.complete(1)  # max_tokens reached
    assert calls[0] == [(0, [5, 6]), (1, [])] and all(len(c) == 1 for c in calls[1:])
    assert paths.discover([0, 1], 4, score_next) == 0 and len(calls) == 4
    assert paths.prefix(2) == []


def test_default_steps_are_a_token_budget_per_prompt():
    """`steps` omitted: DEFAULT_OPD_TOKEN_BUDGET sampled tokens per prompt, so ten prompts get ten times one
    prompt's visits (a budget for the whole job gave ten facts 24 steps, 0/10 learned)."""
    from kiln.training.opd.schemas import DEFAULT_OPD_TOKEN_BUDGET, budget_steps

    assert budget_steps(1, 4, 4, 32) == DEFAULT_OPD_TOKEN_BUDGET // 128 == 96
    assert budget_steps(10, 4, 4, 32) == 240
    assert budget_steps(3, 8, 2, 16) == 3 * DEFAULT_OPD_TOKEN_BUDGET // (3 * 2 * 16)
