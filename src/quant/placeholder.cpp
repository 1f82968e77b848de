// module quant: sources land here
