"""The recipe table's lookups (:mod:`hvd_compress.tools.recipes`)."""
import pytest

from hvd_compress.tools import recipes as R


def test_each_bench_spec_finds_its_recipe_and_tolerance():
    assert R.tolerance_of("none") == 0.0
    assert R.tolerance_of("hvd_fp16") == 0.3
    assert R.tolerance_of("Int8") == R.tolerance_of("Int8()") == 0.3
    assert R.tolerance_of("TopK(0.01)") == 0.5 and R.recipe_of_spec("TopK(0.01)").error_feedback
    assert R.tolerance_of("DGC(0.001)") == 0.5 and R.recipe_of_spec("DGC(0.001)").params["ramp"]["transformer"] == 1
    assert R.tolerance_of("EFSignSGD()") == 1.0 and R.recipe_of_spec("EFSignSGD").placement == "compressor"
    assert R.tolerance_of("Auto()") == 0.5
    assert R.recipe_of_spec("SignSGD()").lr == 0.001


def test_an_unknown_scheme_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"'TopK\(0.1\)' has no recipe; the recipe table has: none, hvd_fp16"):
        R.recipe_of_spec("TopK(0.1)")
