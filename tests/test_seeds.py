import pytest

from orchestrator.errors import UsageError
from orchestrator.seeds import SEED_LIMIT, chain_seeds, validate_base_seed


def test_random_seeds_are_distinct_and_in_range():
    seeds = chain_seeds(500)
    assert len(set(seeds)) == 500
    assert all(0 <= seed < SEED_LIMIT for seed in seeds)


def test_random_chains_differ():
    assert chain_seeds(8) != chain_seeds(8)


def test_base_seed_reproduces_the_chain():
    assert chain_seeds(8, base_seed=1234) == chain_seeds(8, base_seed=1234)
    assert chain_seeds(8, base_seed=1234) != chain_seeds(8, base_seed=1235)


def test_base_seed_prefix_is_stable_when_the_chain_grows():
    assert chain_seeds(12, base_seed=7)[:4] == chain_seeds(4, base_seed=7)


def test_derived_seeds_are_not_offsets():
    seeds = chain_seeds(4, base_seed=100)
    assert seeds != [100, 101, 102, 103]
    assert len(set(seeds)) == 4


@pytest.mark.parametrize("bad", [-1, SEED_LIMIT, 2**40])
def test_base_seed_out_of_range(bad):
    with pytest.raises(UsageError, match="out of range"):
        validate_base_seed(bad)
