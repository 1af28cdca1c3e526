"""hvdlite.spark's tests on Spark's local-cluster mode (see spark_session.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
