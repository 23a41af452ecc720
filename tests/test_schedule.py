from hydra_tune.schedule import Ready, fifo


def test_fifo_picks_longest_waiting_then_affinity():
    ready = [Ready("a", 5, 0), Ready("b", 2, 1), Ready("c", 2, 0)]
    assert fifo(ready, 0) == 2  # b and c waited equally; c last ran on device 0
    assert fifo(ready, 1) == 1
    assert fifo([Ready("a", 1, None)], 3) == 0
