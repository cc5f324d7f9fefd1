"""`python -m eagle3_dagster.train --config job.json`: the torchrun worker (`eagle3_dagster.train.worker.main`)."""

from eagle3_dagster.train.worker import main

if __name__ == "__main__":
    main()
