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


def test_the_sparsifiers_train_twice_the_transformers_steps_and_dense_its_own():
    assert R.budget_steps("TopK(0.01)", "transformer", 640) == R.budget_steps("DGC(0.001)", "transformer", 640) == 1280
    assert R.budget_steps("TopK(0.01)", "cnn", 320) == 320
    for spec in ("none", "hvd_fp16", "BF16()", "PowerSGD(4)"):
        assert R.budget_steps(spec, "transformer", 640) == 640, spec
    # Auto may plan a sparsifier: it trains their budget
    for spec in ("Auto()", "Auto(include_sign=True)"):
        assert R.budget_steps(spec, "transformer", 640) == 1280 and R.budget_steps(spec, "cnn", 320) == 320, spec
    # every model the recipes know has a budget: a missing one would train 0 steps
    assert all(R.per_model(R.SPARSIFIER_BUDGET, m) >= 1 for m in R.MODEL_LR_PER_RANK)
