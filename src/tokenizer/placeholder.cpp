// module tokenizer: sources land here
