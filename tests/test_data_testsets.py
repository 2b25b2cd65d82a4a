"""The named test sets: one table for `tmt download` and `tmt evaluate`, clear errors before any download."""

from __future__ import annotations

import pytest

from transformer_mt.data.testsets import TESTSETS, TestsetError, check_testset_name, fetch_testset


def test_the_paper_test_set_is_the_full_newstest2014():
    assert TESTSETS["newstest2014"] == "wmt14/full" and TESTSETS["newstest2013"] == "wmt13"


def test_unknown_testset_lists_the_known_ones():
    with pytest.raises(TestsetError, match="unknown test set 'newstest2099'; known: newstest2013, newstest2014"):
        check_testset_name("newstest2099")
    with pytest.raises(TestsetError, match="unknown test set 'newstest2099'"):
        fetch_testset("newstest2099", "en", "de")


def test_a_direction_the_set_lacks_is_named():
    with pytest.raises(TestsetError, match="no xx-de direction; it has .*en-de"):
        fetch_testset("newstest2014", "xx", "de")
