%% Runs a PropEr property for EUnit so that a failure names its case: the shrunk
%% counterexample is in the assertion's report, not only in output that a long CI
%% log may cut.
-module(convoy_prop).

-export([check/2]).

%% @doc `ok', or the shrunk counterexample (or PropEr's error) of a failed run.
-spec check(Property :: term(), Options :: list()) -> ok | {counterexample, term()} | term().
check(Prop, Opts) ->
    case proper:quickcheck(Prop, Opts) of
        true -> ok;
        false -> {counterexample, proper:counterexample()};
        Other -> Other
    end.
