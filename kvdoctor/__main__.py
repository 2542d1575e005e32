from kvdoctor.cli import main

main()
