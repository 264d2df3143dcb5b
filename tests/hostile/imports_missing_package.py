# check: No module named 'definitely_not_an_installed_package'
import definitely_not_an_installed_package  # noqa: F401


def build(device):
    return {}
