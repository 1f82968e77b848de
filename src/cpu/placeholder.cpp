// module cpu: sources land here
