"""A projector spec refuses what the projector cannot build, naming the field."""

import pytest

from harmonia.errors import ConfigError
from harmonia.model.projector_spec import PROJECTOR_ACTS, ProjectorSpec


@pytest.mark.parametrize("deepstack", [0, 3])
def test_an_activation_not_implemented_is_refused(deepstack: int) -> None:
    with pytest.raises(ConfigError, match=r"act='swish' is not implemented"):
        ProjectorSpec("vision_proj", 64, 32, 32, act="swish", deepstack=deepstack)


@pytest.mark.parametrize("act", PROJECTOR_ACTS)
def test_every_implemented_activation_builds(act: str) -> None:
    from harmonia.model.projector import Projector

    spec = ProjectorSpec("vision_proj", 64, 32, 32, act=act)
    assert sum(p.numel() for p in Projector(spec).parameters()) == spec.n_params()


def test_bad_widths_and_norms_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"hidden=0 is invalid"):
        ProjectorSpec("vision_proj", 64, 32, 0)
    with pytest.raises(ConfigError, match=r"norm_groups=3 must divide in_dim=64"):
        ProjectorSpec("vision_proj", 64, 32, 32, norm_groups=3)
    with pytest.raises(ConfigError, match=r"deepstack=3 needs in_dim=66"):
        ProjectorSpec("vision_proj", 66, 32, 32, deepstack=3)
