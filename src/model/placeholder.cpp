// module model: sources land here
