"""stoker's processes: api, tokenizer, scheduler, worker, plus the in-process engine."""
