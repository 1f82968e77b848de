// module guard: sources land here
