import pytest

from contract.job_env import SEED_LIMIT
from contract.seeds import chain_seeds
from orchestrator.errors import UsageError
from orchestrator.seeds import validate_base_seed


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


def test_manifest_from_another_version_still_loads(tmp_path):
    """Run dirs outlive releases: unknown manifest fields are ignored, not fatal."""
    import json

    from orchestrator.manifest import Manifest

    path = tmp_path / "manifest.json"
    path.write_text(
        json.dumps(
            {
                "chain_id": "c",
                "recipe": "r.sub",
                "recipe_sha256": "0" * 64,
                "script": "s",
                "run_dir": str(tmp_path),
                "backend": "slurm",
                "dependency_kind": "afterany",
                "num_jobs": 1,
                "args": [],
                "base_seed": None,
                "git_sha": None,
                "git_dirty": None,
                "created": 1.0,
                "added_later": True,
                "jobs": [{"index": 0, "seed": 5, "job_id": "7", "exit_code": 0, "state": None}],
            }
        )
    )
    manifest = Manifest.load(path)
    assert manifest.jobs[0].seed == 5 and manifest.job_ids() == ["7"]
