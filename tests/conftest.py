import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# The longest modules first (about 15, 11, 10 and 5 minutes on 2 cores), so that pytest-xdist's workers
# (tools/test.sh: a file per worker at a time) do not end on one of them alone.
LONGEST_FIRST = ("test_slurm.py", "test_ft.py", "test_runtime.py", "test_resume.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
