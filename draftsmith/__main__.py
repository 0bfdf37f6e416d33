from draftsmith.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
