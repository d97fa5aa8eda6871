"""`python -m mambaserve.eval ARGS`: lm_eval's command line, with `--model mambaserve` known.

ARGS are lm_eval's own, e.g. `--model mambaserve --model_args pretrained=DIR,dtype=bfloat16
--tasks gsm8k --num_fewshot 5 --batch_size auto`.
"""

from lm_eval.__main__ import cli_evaluate

import mambaserve.eval  # noqa: F401  (registers the model)

if __name__ == "__main__":
    cli_evaluate()
