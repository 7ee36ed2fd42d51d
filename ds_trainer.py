"""Train GPT-2 with DeepSpeed on a MongoDB corpus.

    deepspeed ds_trainer.py --deepspeed_config configs/ds_config.json --config_train configs/mongo.json ...
    python ds_trainer.py --deepspeed_config configs/ds_config_cpu.json --config_train ... --model_select tiny

`python ds_trainer.py --help` lists every flag.
"""

from dsgpt2.train.trainer import main

if __name__ == "__main__":
    raise SystemExit(main())
