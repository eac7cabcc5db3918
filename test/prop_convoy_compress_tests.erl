%% PropEr properties of compressed batches (`convoy_compress'), run from EUnit:
%% <ul>
%% <li>any list of entries, at any level, decodes to itself;</li>
%% <li>what a lane ships (`envelope/5') is the plain batch, or a compressed one
%%   only where the setting, the peer's version, the batch's messages and bytes
%%   allow it, smaller than the bytes, and decoding to exactly the entries;</li>
%% <li>whatever arrives as a compressed batch's payload, decoding never crashes:
%%   it answers the proper list the payload encodes, or `error'.</li>
%% </ul>
-module(prop_convoy_compress_tests).

-export([prop_roundtrip/0, prop_envelope/0, prop_decode_any/0]).

-include_lib("proper/include/proper.hrl").
-include_lib("eunit/include/eunit.hrl").

%% Each property with its number of cases, named after it so that a failure says
%% which one.
properties_test_() ->
    [{atom_to_list(Name), {timeout, 120, ?_assertEqual(ok, check(Name, N))}}
     || {Name, N} <- [{prop_roundtrip, 1000}, {prop_envelope, 1000}, {prop_decode_any, 2000}]].

check(Name, N) ->
    convoy_prop:check(?MODULE:Name(), [{numtests, N}, {to_file, user}, {max_shrinks, 300}]).

%% Evaluate a check, turning an exception into a printed failure (PropEr 1.2
%% cannot report one on OTP 25).
safe(Name, Input, Fun) ->
    Result = try Fun() catch C:R:St -> {crashed, C, R, St} end,
    ?WHENFAIL(io:format(user, "~p on ~P~n=> ~P~n", [Name, Input, 40, Result, 60]),
              Result =:= true).

%%--------------------------------------------------------------------
%% Generators

level() -> choose(1, 9).

%% Entries as a lane's batch carries them, repetitive enough to compress at times.
entry() ->
    frequency([{4, {self(), any()}},
               {3, {self(), {event, nat(), <<"user-42">>, #{k => nat(), body => body()}}}},
               {1, {[self(), foo], any()}},
               {1, {'$convoy_publish', pg, any(), any()}}]).

body() -> ?LET(N, choose(0, 200), binary:copy(<<"abc">>, N)).

setting() -> oneof([never, level()]).

%%--------------------------------------------------------------------
%% Properties

prop_roundtrip() ->
    ?FORALL({Entries, Level}, {list(any()), level()},
            safe(roundtrip, Entries,
                 fun() ->
                         convoy_compress:decode(convoy_compress:encode(Entries, Level))
                             =:= {ok, Entries}
                 end)).

prop_envelope() ->
    ?FORALL({Entries, Setting, Vsn}, {list(entry()), setting(), choose(1, 5)},
            safe(envelope, {Entries, Setting, Vsn},
                 fun() -> envelope_ok(Entries, Setting, Vsn) end)).

envelope_ok(Entries, Setting, Vsn) ->
    Msgs = length(Entries),
    Bytes = lists:sum([erlang:external_size(element(2, E)) || E <- Entries]),
    Plain = convoy_wire:batch(a@h, Entries),
    case convoy_compress:envelope(a@h, Entries, {Msgs, Bytes}, Setting, Vsn) of
        {batch, Batch} ->
            Batch =:= Plain;
        {zbatch, Z, Out} ->
            {zbatch, 1, a@h, Bin} = convoy_wire:decode(Z),
            Setting =/= never andalso Vsn >= 4 andalso Msgs >= 2
                andalso Bytes >= convoy_compress:min_bytes()
                andalso Out =:= byte_size(Bin) andalso Out < Bytes
                andalso convoy_compress:decode(Bin) =:= {ok, Entries}
    end.

prop_decode_any() ->
    ?FORALL(Payload, payload(),
            safe(decode, Payload,
                 fun() ->
                         case convoy_compress:decode(Payload) of
                             {ok, L} -> is_binary(Payload) andalso binary_to_term(Payload) =:= L
                                            andalso proper_list(L);
                             error -> not decodes_to_list(Payload)
                         end
                 end)).

%% Random bytes, compressed terms of any kind (lists among them, improper ones
%% too), corrupted compressed terms, and terms that are not binaries.
payload() ->
    frequency([{3, binary()},
               {3, ?LET({T, L}, {any(), level()}, term_to_binary(T, [{compressed, L}]))},
               {2, ?LET({T, L}, {list(any()), level()}, term_to_binary(T, [{compressed, L}]))},
               {1, ?LET({T, L, Tail}, {non_empty(list(any())), level(), oneof([a, 1, <<>>])},
                        term_to_binary(lists:foldr(fun(E, Acc) -> [E | Acc] end, Tail, T),
                                       [{compressed, L}]))},
               {2, ?LET({T, Cut}, {list(any()), nat()},
                        corrupt(term_to_binary(T, [compressed]), Cut))},
               {1, any()}]).

corrupt(Bin, Cut) ->
    N = byte_size(Bin),
    case N > 8 of
        true -> <<(binary:part(Bin, 0, N - 1 - Cut rem (N - 7)))/binary, 0>>;
        false -> Bin
    end.

decodes_to_list(Payload) when is_binary(Payload) ->
    try binary_to_term(Payload) of
        T -> proper_list(T)
    catch
        error:badarg -> false
    end;
decodes_to_list(_) ->
    false.

proper_list([]) -> true;
proper_list([_ | T]) -> proper_list(T);
proper_list(_) -> false.
