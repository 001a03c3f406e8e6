"""`python -m services.tokenizer --model PATH [--id NAME] [--max-model-len N]`."""

from services.tokenizer.service import main

main()
