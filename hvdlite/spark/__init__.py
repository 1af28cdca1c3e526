"""hvdlite on Spark: a function run on every task of a barrier stage, as one world.

    import hvdlite.spark

    def train(lr):
        import hvdlite.torch as hvd
        hvd.init()
        ...
        return hvd.rank(), loss

    results = hvdlite.spark.run(train, args=(0.1,), num_proc=4)   # rank order

Each rank is one task of a Spark barrier stage; hvdliterun, run on the driver, starts
the ranks on the tasks' hosts through the tasks themselves (see driver.py). The Spark
workers need the driver's Python environment at the same path (hvdlite, its MPI,
pyspark). ``run_elastic`` is not offered: see docs/spark.md.
"""
from hvdlite.spark.driver import SparkJobError, run

__all__ = ["SparkJobError", "run"]
