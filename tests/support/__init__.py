"""What several test folders share, one module per concern: `bits` (bit-for-bit tensor comparison),
`world_sizes` (several world sizes in one spawned job), `shared_gpu` (several ranks on one GPU). tests/ is on
``sys.path`` (pytest puts conftest.py's folder there, and spawned ranks inherit it), so tests import
``support.<module>``."""
