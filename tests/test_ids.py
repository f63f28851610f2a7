"""Turn and step ids: their shape, their order, and their random part."""

from __future__ import annotations

import os
import re

from actors import ids

SHAPE = re.compile(r"^t_[0-9a-z]{9}[0-9a-z]{8}$")


def test_turn_ids_have_dispach_v1_shape_sort_by_time_and_do_not_repeat() -> None:
    made = [ids.turn_id() for _ in range(50_000)]
    assert all(SHAPE.match(i) for i in made)
    assert len(set(made)) == len(made)
    stamps = [i[2:11] for i in made]
    assert stamps == sorted(stamps)  # the millisecond stamp leads: ids sort by creation
    assert ids.step_id().startswith("s_")


def test_the_random_part_is_spread_over_its_whole_range() -> None:
    bound = 36**8
    draws = [ids._ENTROPY.below(bound) for _ in range(20_000)]
    assert all(0 <= d < bound for d in draws)
    # each quarter of the range gets its share (a stuck or narrow source would not)
    quarters = [sum(1 for d in draws if q * bound // 4 <= d < (q + 1) * bound // 4)
                for q in range(4)]  # fmt: skip
    assert all(4_000 < n < 6_000 for n in quarters)


def test_a_forked_child_does_not_repeat_its_parents_random_bytes() -> None:
    ids.turn_id()  # the parent holds a pool of bytes not handed out yet
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next draw, to the parent
        os.write(write, ids._ENTROPY.below(2**63).to_bytes(8, "big"))
        os._exit(0)
    os.close(write)
    child = int.from_bytes(os.read(read, 8), "big")
    os.close(read)
    os.waitpid(pid, 0)
    assert ids._ENTROPY.below(2**63) != child
