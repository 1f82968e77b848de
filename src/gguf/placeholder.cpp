// module gguf: sources land here
