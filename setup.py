"""The folders the design card fixes at the top level (services/, common/, kernels/), with
tools/ and the bundled models/, install under one import name, `stoker`, so none of them
shadows another distribution's top-level package (Hugging Face's `kernels` above all;
docs/architecture.md, "Package layout"). pyproject.toml holds everything else."""

from setuptools import find_packages, setup

ROOTS = ("services", "common", "kernels", "tools")
packages = ["stoker", "stoker.models"]
packages += [f"stoker.{p}" for p in find_packages(include=[f"{r}*" for r in ROOTS])]
package_dir = {"stoker": "stoker", "stoker.models": "models"}
package_dir.update({f"stoker.{r}": r for r in ROOTS})

setup(packages=packages, package_dir=package_dir)
