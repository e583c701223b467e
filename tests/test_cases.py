"""The local copies of the acceptance cases equal the shared originals."""
import pytest

from tests import cases


@pytest.mark.skipif(not cases.SHARED.exists(), reason="../shared/ is not beside the clone")
@pytest.mark.parametrize("name", cases.FILES)
def test_local_copy_equals_the_shared_original(name):
    assert (cases.LOCAL / name).read_bytes() == (cases.SHARED / name).read_bytes(), \
        f"cp {cases.SHARED / name} {cases.LOCAL / name}: the acceptance cases changed"
