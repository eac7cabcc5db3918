%% Minimal JSON for the harness's results (OTP 25 has no json module): `encode/1'
%% for maps, lists, binaries, atoms and numbers; `decode/1' so tests can check that
%% what was written parses back.
-module(convoy_bench_json).

-export([encode/1, decode/1]).

-type json() :: #{binary() => json()} | [json()] | binary() | number() | boolean() | null.
-export_type([json/0]).

%% @doc JSON text of `Term'. Map keys and atoms become strings; `undefined' and
%% `null' become null; tuples are not accepted.
-spec encode(term()) -> iodata().
encode(M) when is_map(M) ->
    Pairs = [[encode(key(K)), $:, encode(V)] || {K, V} <- lists:sort(maps:to_list(M))],
    [${, lists:join($,, Pairs), $}];
encode(L) when is_list(L) -> [$[, lists:join($,, [encode(X) || X <- L]), $]];
encode(true) -> <<"true">>;
encode(false) -> <<"false">>;
encode(null) -> <<"null">>;
encode(undefined) -> <<"null">>;
encode(A) when is_atom(A) -> encode(atom_to_binary(A));
encode(I) when is_integer(I) -> integer_to_binary(I);
encode(F) when is_float(F) -> float_to_binary(F, [short]);
encode(B) when is_binary(B) -> [$", escape(B), $"].

key(K) when is_binary(K) -> K;
key(K) when is_atom(K) -> atom_to_binary(K);
key(K) when is_integer(K) -> integer_to_binary(K);
key(K) -> iolist_to_binary(io_lib:format("~p", [K])).

escape(B) ->
    << <<(esc(C))/binary>> || <<C/utf8>> <= B >>.

esc($") -> <<"\\\"">>;
esc($\\) -> <<"\\\\">>;
esc($\n) -> <<"\\n">>;
esc($\r) -> <<"\\r">>;
esc($\t) -> <<"\\t">>;
esc(C) when C < 32 -> iolist_to_binary(io_lib:format("\\u~4.16.0b", [C]));
esc(C) -> <<C/utf8>>.

%% @doc Parse JSON text. Objects become maps with binary keys.
-spec decode(iodata()) -> {ok, json()} | {error, term()}.
decode(Text) ->
    try value(ws(iolist_to_binary(Text))) of
        {V, Rest} ->
            case ws(Rest) of
                <<>> -> {ok, V};
                Trailing -> {error, {trailing, byte_size(Trailing)}}
            end
    catch
        throw:Reason -> {error, Reason};
        error:Reason -> {error, Reason}
    end.

value(<<${, R/binary>>) -> object(ws(R), #{});
value(<<$[, R/binary>>) -> array(ws(R), []);
value(<<$", R/binary>>) -> string(R, <<>>);
value(<<"true", R/binary>>) -> {true, R};
value(<<"false", R/binary>>) -> {false, R};
value(<<"null", R/binary>>) -> {null, R};
value(<<C, _/binary>> = B) when C =:= $-; C >= $0, C =< $9 -> number(B);
value(B) -> throw({unexpected, binary:part(B, 0, min(10, byte_size(B)))}).

object(<<$}, R/binary>>, Acc) when map_size(Acc) =:= 0 -> {Acc, R};
object(<<$", R0/binary>>, Acc) ->
    {K, R1} = string(R0, <<>>),
    <<$:, R2/binary>> = ws(R1),
    {V, R3} = value(ws(R2)),
    case ws(R3) of
        <<$,, R4/binary>> -> object(ws(R4), Acc#{K => V});
        <<$}, R4/binary>> -> {Acc#{K => V}, R4};
        _ -> throw(bad_object)
    end;
object(_, _) -> throw(bad_object).

array(<<$], R/binary>>, []) -> {[], R};
array(B, Acc) ->
    {V, R} = value(B),
    case ws(R) of
        <<$,, R2/binary>> -> array(ws(R2), [V | Acc]);
        <<$], R2/binary>> -> {lists:reverse([V | Acc]), R2};
        _ -> throw(bad_array)
    end.

string(<<$", R/binary>>, Acc) -> {Acc, R};
string(<<$\\, $u, H:4/binary, R/binary>>, Acc) ->
    string(R, <<Acc/binary, (binary_to_integer(H, 16))/utf8>>);
string(<<$\\, C, R/binary>>, Acc) ->
    string(R, <<Acc/binary, (unesc(C))>>);
string(<<C, R/binary>>, Acc) when C >= 32 -> string(R, <<Acc/binary, C>>);
string(_, _) -> throw(bad_string).

unesc($n) -> $\n;
unesc($r) -> $\r;
unesc($t) -> $\t;
unesc($b) -> $\b;
unesc($f) -> $\f;
unesc(C) when C =:= $"; C =:= $\\; C =:= $/ -> C;
unesc(_) -> throw(bad_escape).

number(B) ->
    {match, [{0, Len}]} = re:run(B, "^-?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?",
                                 [{capture, first}]),
    <<N:Len/binary, R/binary>> = B,
    {to_number(N), R}.

to_number(N) ->
    try binary_to_integer(N)
    catch error:badarg ->
            try binary_to_float(N)
            catch error:badarg ->
                    %% "1e5" and "2.0e5" forms: give binary_to_float a fraction.
                    [M, E] = re:split(N, "[eE]"),
                    binary_to_float(<<(with_fraction(M))/binary, "e", E/binary>>)
            end
    end.

with_fraction(M) ->
    case binary:match(M, <<".">>) of
        nomatch -> <<M/binary, ".0">>;
        _ -> M
    end.

ws(<<C, R/binary>>) when C =:= $\s; C =:= $\n; C =:= $\r; C =:= $\t -> ws(R);
ws(B) -> B.

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

round_trip_test() ->
    T = #{a => [1, 2.5, <<"x\"y">>, true, null], <<"b">> => #{}, c => []},
    ?assertEqual({ok, #{<<"a">> => [1, 2.5, <<"x\"y">>, true, null],
                        <<"b">> => #{}, <<"c">> => []}},
                 decode(encode(T))).

numbers_test() ->
    ?assertEqual({ok, [-1, 1.0e5, 2.5e-3]}, decode(<<"[-1, 1e5, 2.5e-3]">>)).

bad_test() ->
    ?assertMatch({error, _}, decode(<<"{\"a\" 1}">>)),
    ?assertMatch({error, _}, decode(<<"[1,]">>)),
    ?assertMatch({error, _}, decode(<<"[1] x">>)).
-endif.
