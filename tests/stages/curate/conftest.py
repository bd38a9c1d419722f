from tests.data_curation.conftest import bench_dir  # noqa: F401  (the fixture)
