"""The README's plain `python -m pytest` is deterministic: without CI set, Hypothesis runs the
derandomized "dev" profile with no example database; random draws are opt-in ("explore")."""

from __future__ import annotations

from hypothesis import settings

from tests.conftest import hypothesis_profile


def test_the_default_profile_is_derandomized_without_a_database():
    assert hypothesis_profile({}) == "dev"
    assert hypothesis_profile({"CI": "true"}) == "ci"
    for name in ("dev", "ci"):
        profile = settings.get_profile(name)
        assert profile.derandomize and profile.database is None, name


def test_random_exploration_is_available_by_name():
    assert hypothesis_profile({"ATTNGEN_HYPOTHESIS_PROFILE": "explore"}) == "explore"
    explore = settings.get_profile("explore")
    assert not explore.derandomize and explore.database is not None
