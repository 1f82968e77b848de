// module run: sources land here
